"""The training loop of the embedded default models (CI never trains the real ones): a few
steps of each architecture's smoke configuration on a slice of the stdlib corpus lower the
loss, are deterministic, measure held-out routing as the engine routes, and write a model
that ftjax loads and runs with its tokenizer, whose chat tokens are single ids and whose chat
template renders Qwen's format."""

import io
import json
import os

import numpy as np
import pytest

import ftjax
from ftjax.decode import run_decode
from ftjax.research import routing_stats
from ftjax.research.traces import Trace
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.tiny import train


@pytest.fixture(scope="module", params=train.ARCHS)
def smoke(request, tmp_path_factory):
  cfg = train.SMOKE_CONFIGS[request.param]
  out = str(tmp_path_factory.mktemp(f"smoke_{request.param}") / "model")
  log = io.StringIO()
  result = train.train(out, cfg, seed=0, corpus_bytes=200_000, log=log, progress=False)
  return cfg, out, result, log.getvalue()


def test_smoke_configurations_are_the_two_architectures():
  moe, hybrid = (train.SMOKE_CONFIGS[a].model_config() for a in ("moe", "hybrid"))
  assert moe.model_type == "qwen3_moe" and set(moe.layer_types) == {"full_attention"}
  assert hybrid.model_type == "qwen3_5_moe"
  assert hybrid.layer_types == ("linear_attention",) * 3 + ("full_attention",)
  assert hybrid.shared_expert_gate and hybrid.attn_output_gate and hybrid.norm_zero_centred
  # The shipped configurations, likewise (their size is the model card's).
  real = train.CONFIGS["hybrid"].model_config()
  assert real.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
  assert train.CONFIGS["moe"] == train.TrainConfig()
  with pytest.raises(ValueError, match="linear attention"):
    train.TrainConfig(arch="hybrid")  # an interval of 1 has no linear attention layer


def test_loss_decreases_and_beats_nothing_trivial(smoke):
  cfg, _, result, log = smoke
  history = result["history"]
  assert len(history) == cfg.steps // cfg.heldout_every
  # Initial loss of a uniform predictor is ln(V); training must be well below it, and the
  # held-out loss must fall from the first evaluation to the last.
  assert history[0]["train_loss"] < np.log(cfg.vocab_size) + 0.1
  assert history[-1]["heldout_loss"] < history[0]["heldout_loss"] - 0.2
  assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.2
  assert "held-out" in log and "unigram" in log and "expert overlap" in log


def test_writes_a_loadable_model_with_its_tokenizer(smoke):
  cfg, out, result, _ = smoke
  assert sorted(os.listdir(out)) == ["dense.bin", "experts.bin", "ftw.json", "tokenizer.json",
                                     "tokenizer_config.json", "train_log.json"]
  model = ftjax.load(out)  # verifies the checksums
  assert model.config == cfg.model_config()
  assert model.source["trained"] and model.source["arch"] == cfg.arch
  assert model.dtype == np.dtype("bfloat16")
  with open(os.path.join(out, "train_log.json")) as f:
    log = json.load(f)
  assert log["heldout_loss"] == result["heldout_loss"]
  assert log["heldout_expert_overlap"] == result["heldout_expert_overlap"]
  r = run_decode(out, "def f(x):", max_new_tokens=6, greedy=True, out=io.StringIO(),
                 log=io.StringIO())
  assert r.tokenizer == "tokenizer.json" and len(r.generation.tokens) == 6


def test_heldout_routing_is_the_engines(smoke):
  """The recorded routing statistics are those of the written (bfloat16) model as the engine
  routes the same held-out sequences (as benchmarks/default_model.py measures them)."""
  cfg, out, result, _ = smoke
  routing = result["heldout_routing"]
  assert (routing["sequences"], routing["tokens"]) == (cfg.routing_sequences,
                                                       cfg.routing_tokens)
  assert len(routing["consecutive_overlap"]["per_layer"]) == cfg.num_layers
  assert result["heldout_expert_overlap"] == routing["consecutive_overlap"]["mean"]
  assert 0.0 <= result["heldout_expert_overlap"] <= 1.0

  model = ftjax.load(out)
  tok = load_tokenizer(out, cfg.vocab_size)
  root = train.stdlib_root()
  _, held_files = train.corpus_files(root, cfg.heldout_mod)
  sequences = []
  for text in train.read_texts(root, held_files, 200_000 // 4):
    ids = tok.encode(text)
    if len(ids) >= cfg.routing_tokens:
      sequences.append(ids[:cfg.routing_tokens])
  sequences = sequences[:cfg.routing_sequences]
  engine = ftjax.Engine(model, kernels="xla", record_routing=True)
  for seq in sequences:
    engine.forward_logits(seq)
  engine_stats = routing_stats.summary(Trace.from_engine(engine), phase=None)
  # The same routes up to float rounding (a top-k near-tie may flip a route or two).
  np.testing.assert_allclose(engine_stats["consecutive_overlap"]["per_layer"],
                             routing["consecutive_overlap"]["per_layer"], atol=0.03)


def test_deterministic_for_a_seed(tmp_path):
  short = train.dataclasses.replace(train.SMOKE, steps=10, heldout_every=10)
  a = train.train(str(tmp_path / "a"), short, seed=0, corpus_bytes=200_000, log=io.StringIO(),
                  progress=False)
  b = train.train(str(tmp_path / "b"), short, seed=0, corpus_bytes=200_000, log=io.StringIO(),
                  progress=False)
  assert a["history"][-1]["heldout_loss"] == b["history"][-1]["heldout_loss"]
  assert a["heldout_routing"] == b["heldout_routing"]
  for name in ("dense.bin", "experts.bin", "tokenizer.json", "tokenizer_config.json"):
    with open(tmp_path / "a" / name, "rb") as fa, open(tmp_path / "b" / name, "rb") as fb:
      assert fa.read() == fb.read(), name


def test_chat_tokens_are_single_ids(smoke):
  cfg, out, _, _ = smoke
  ids = train.chat_token_ids(cfg.vocab_size)
  assert list(ids) == list(train.CHAT_TOKENS)
  assert sorted(ids.values()) == list(range(cfg.vocab_size - 8, cfg.vocab_size))
  tok = load_tokenizer(out, cfg.vocab_size)  # ftjax's own tokenizer wrapper
  assert tok.encode(train.EOS) == [0]
  for token, i in ids.items():
    assert tok.encode(token) == [i], token
    assert tok.decode([i]) == token
  text = "<|im_start|>user\ndef f(x):<|im_end|>\n<tool_call>{}</tool_call><think>x</think>"
  encoded = tok.encode(text)
  assert tok.decode(encoded) == text
  assert [i for i in encoded if i in ids.values()] == [
      ids[t] for t in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>",
                       "</think>")]
  with open(os.path.join(out, "tokenizer.json")) as f:
    added = {t["content"]: t for t in json.load(f)["added_tokens"]}
  assert added[train.EOS]["id"] == 0 and added[train.EOS]["special"]
  for token, i in ids.items():  # as in Qwen's tokenizers: only the turn markers are special
    assert added[token]["id"] == i
    assert added[token]["special"] == (token in ("<|im_start|>", "<|im_end|>"))
  assert cfg.model_config().eos_token_ids == (0, ids["<|im_end|>"])


TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Reads a file <as text>",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "What is in setup.py?"},
    {"role": "assistant", "content": "Let me look.", "reasoning_content": "Read it first.",
     "tool_calls": [{"type": "function", "function": {"name": "read_file",
                                                      "arguments": {"path": "setup.py"}}}]},
    {"role": "tool", "content": "import setuptools"},
    {"role": "assistant", "content": "<think>\nShort.\n</think>\n\nIt imports setuptools."},
    {"role": "user", "content": "Thanks."},
]
RENDERED = (
    "<|im_start|>system\nYou write Python.\n\n# Tools\n\nYou may call the functions below to "
    "answer. Their signatures are given as JSON objects, one a line, inside <tools></tools>:\n"
    "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>\n\nTo call a "
    "function, write its name and its arguments as a JSON object inside "
    "<tool_call></tool_call>:\n<tool_call>\n{\"name\": <function name>, \"arguments\": "
    "<arguments as a JSON object>}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\nWhat is in setup.py?<|im_end|>\n"
    # Reasoning before the last user query is dropped.
    "<|im_start|>assistant\nLet me look.\n<tool_call>\n{\"name\": \"read_file\", "
    "\"arguments\": {\"path\": \"setup.py\"}}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\nimport setuptools\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nIt imports setuptools.<|im_end|>\n"
    "<|im_start|>user\nThanks.<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_renders_qwen_turns_and_tool_calls(smoke):
  transformers = pytest.importorskip(
      "transformers", reason="renders the chat template as transformers does (test extra)")
  cfg, out, _, _ = smoke
  hf = transformers.AutoTokenizer.from_pretrained(out)
  text = hf.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False,
                                add_generation_prompt=True, enable_thinking=False)
  assert text == RENDERED
  ids = train.chat_token_ids(cfg.vocab_size)
  encoded = load_tokenizer(out, cfg.vocab_size).encode(text)
  assert encoded == hf(text, add_special_tokens=False)["input_ids"]
  names = {i: t for t, i in ids.items()}
  assert [names[i] for i in encoded if i in names] == (
      # The system turn's instructions show the tool-call markup: ids too, as in Qwen's.
      ["<|im_start|>"] + ["<tool_call>", "</tool_call>"] * 2 + ["<|im_end|>"]
      + ["<|im_start|>", "<|im_end|>"]
      + ["<|im_start|>", "<tool_call>", "</tool_call>", "<|im_end|>"]
      + ["<|im_start|>", "<tool_response>", "</tool_response>", "<|im_end|>"]
      + ["<|im_start|>", "<|im_end|>"] * 2 + ["<|im_start|>", "<think>", "</think>"])

  # In the turns after the last user query (a tool loop), reasoning is kept; the generation
  # prompt opens a turn in which the model thinks.
  loop = hf.apply_chat_template(CONVERSATION[:5], tokenize=False, add_generation_prompt=False)
  assert loop.endswith(
      "<|im_start|>assistant\n<think>\nRead it first.\n</think>\n\nLet me look.\n<tool_call>\n"
      "{\"name\": \"read_file\", \"arguments\": {\"path\": \"setup.py\"}}\n</tool_call>"
      "<|im_end|>\n<|im_start|>user\n<tool_response>\nimport setuptools\n</tool_response>"
      "<|im_end|>\n<|im_start|>assistant\n<think>\nShort.\n</think>\n\nIt imports "
      "setuptools.<|im_end|>\n")
  assert loop.startswith("<|im_start|>system\nYou write Python.<|im_end|>\n")
  prompt = hf.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
  assert prompt == "<|im_start|>user\nWhat is in setup.py?<|im_end|>\n<|im_start|>assistant\n"


def test_held_out_split_is_by_file_and_disjoint():
  train_files, held = train.corpus_files()
  assert held and train_files and not set(held) & set(train_files)
  assert all(f.endswith(".py") for f in train_files + held)
  assert not any(part in ("test", "tests", "site-packages")
                 for f in train_files + held for part in f.split(os.sep))


def test_refuses_to_replace_a_directory_that_is_not_a_model(tmp_path):
  (tmp_path / "notes.txt").write_text("keep me")
  with pytest.raises(FileExistsError, match="refusing to replace"):
    train.train(str(tmp_path), train.SMOKE, corpus_bytes=50_000, log=io.StringIO(),
                progress=False)
  assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_the_hybrid_model_gets_a_trained_mtp_head(smoke):
  """The hybrid configurations train a multi-token-prediction head in a second stage, on the
  finished model; the moe ones none. The written model drafts with it, and speculative greedy
  decoding gives the plain greedy tokens."""
  cfg, out, result, log = smoke
  model = ftjax.load(out)
  if cfg.arch == "moe":
    assert cfg.mtp_layers == 0 and "mtp" not in result and model.config.mtp_layers == 0
    return
  assert train.CONFIGS["hybrid"].mtp_layers == 1 and train.CONFIGS["hybrid"].mtp_steps > 0
  mtp = result["mtp"]
  assert model.config.mtp_layers == cfg.mtp_layers == mtp["layers"] == 1
  assert model.source["mtp"]["heldout_agreement"] == mtp["heldout_agreement"]
  assert len(mtp["history"]) == 1 + cfg.mtp_steps // cfg.heldout_every == 3  # step 0 first
  first, last = mtp["history"][0], mtp["history"][-1]
  assert first["step"] == 0 and last["step"] == cfg.mtp_steps
  assert last["heldout_loss"] < first["heldout_loss"] - 0.5  # the random head, then trained
  assert 0.0 <= last["heldout_agreement"] <= 1.0
  assert "MTP step" in log and "the head's top token is the model's" in log
  runs = {mode: run_decode(out, "def f(x):", max_new_tokens=8, greedy=True, kernels="xla",
                           speculative=mode, draft_tokens=2, out=io.StringIO(),
                           log=io.StringIO()) for mode in ("none", "mtp")}
  assert runs["mtp"].generation.tokens == runs["none"].generation.tokens


def test_the_head_alone_on_the_finished_model_equals_the_whole_run(tmp_path):
  """``train_head`` (``--trunk_from``) on the model that the first stage wrote gives the files
  that the whole run writes: the trunk's tensors copied unchanged, the same head."""
  cfg = train.dataclasses.replace(train.SMOKE_HYBRID, steps=10, heldout_every=10, mtp_steps=10)
  kw = dict(seed=0, corpus_bytes=200_000, log=io.StringIO(), progress=False)
  whole = train.train(str(tmp_path / "whole"), cfg, **kw)
  trunk_only = train.dataclasses.replace(cfg, mtp_layers=0, mtp_steps=0)
  train.train(str(tmp_path / "trunk"), trunk_only, **kw)
  headed = train.train_head(str(tmp_path / "trunk"), str(tmp_path / "head"), cfg, **kw)
  assert headed["config"] == whole["config"] == train.dataclasses.asdict(cfg)
  assert headed["mtp"]["history"] == [dict(h, elapsed_s=h2["elapsed_s"]) for h, h2 in
                                      zip(whole["mtp"]["history"], headed["mtp"]["history"])]
  for name in ("dense.bin", "experts.bin", "tokenizer.json"):
    with open(tmp_path / "whole" / name, "rb") as fa, open(tmp_path / "head" / name, "rb") as fb:
      assert fa.read() == fb.read(), name
  trunk, head = ftjax.load(str(tmp_path / "trunk")), ftjax.load(str(tmp_path / "head"))
  ours = train.model_lib.named_params(head)
  for name, value in train.model_lib.named_params(trunk).items():
    assert np.array_equal(value.view(np.uint16), ours[name].view(np.uint16)), name
  n = trunk.config.num_moe_layers
  assert np.array_equal(np.asarray(trunk.bank).view(np.uint16),
                        np.asarray(head.bank)[:n].view(np.uint16))
  with pytest.raises(ValueError, match="has an MTP head already"):
    train.train_head(str(tmp_path / "head"), str(tmp_path / "again"), cfg, **kw)
  with pytest.raises(ValueError, match="trains no MTP head"):
    train.train_head(str(tmp_path / "trunk"), str(tmp_path / "again"), trunk_only, **kw)
  with pytest.raises(ValueError, match="needs training steps"):
    train.dataclasses.replace(cfg, mtp_steps=0)
  with pytest.raises(ValueError, match="for the hybrid architecture"):
    train.dataclasses.replace(train.SMOKE, mtp_layers=1, mtp_steps=5)


def test_with_mtp_head_keeps_the_trunk_and_refuses_what_it_cannot_extend():
  model_lib = train.model_lib
  trunk = model_lib.random_model(train.SMOKE_HYBRID.trunk_config(), seed=3, dtype="bfloat16")
  headed = model_lib.with_mtp_head(trunk, seed=0)
  assert headed.config == train.SMOKE_HYBRID.model_config()
  ours, theirs = model_lib.named_params(headed), model_lib.named_params(trunk)
  assert set(ours) - set(theirs) and all(n.startswith("mtp.") for n in set(ours) - set(theirs))
  for name, value in theirs.items():
    assert np.array_equal(value.view(np.uint16), ours[name].view(np.uint16)), name
  n = trunk.config.num_moe_layers
  assert headed.bank.shape == (n + 1,) + trunk.bank.shape[1:]
  assert np.array_equal(np.asarray(headed.bank[:n]).view(np.uint16),
                        np.asarray(trunk.bank).view(np.uint16))
  assert np.any(np.asarray(headed.bank[n], np.float32) != 0)  # the head's own experts
  with pytest.raises(ValueError, match="has 1 MTP layers already"):
    model_lib.with_mtp_head(headed)
  with pytest.raises(ValueError, match="float experts"):
    model_lib.with_mtp_head(model_lib.quantize_experts(trunk, "int8"))
