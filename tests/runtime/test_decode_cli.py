"""``python -m ftjax.decode`` and the embedded default model."""

import dataclasses
import io
import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.formats import ftw
from ftjax.decode import run_decode
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.assets import DEFAULT_MODEL_DIR, EMBEDDED_MODELS
from ftjax.tiny import train

import tolerances


def _tokens(text):
  return load_tokenizer(DEFAULT_MODEL_DIR, 0).encode(text)


def _run(*flags, cwd):
  return subprocess.run([sys.executable, "-m", "ftjax.decode", *flags], capture_output=True,
                        text=True, check=False, cwd=cwd)


def test_no_flags_runs_the_embedded_default_model(tmp_path):
  proc = _run("--max_new_tokens=8", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("def fibonacci(n):")
  assert "embedded default model 'default' (trained" in proc.stderr
  # The weights were copied into memory before the first step, and it says so (issue 34).
  assert re.search(r"^ftjax: copied the weights \(0\.0\d GB\) into memory in \d+\.\d s "
                   r"\(--load_mode=mmap maps the files instead\)$", proc.stderr, re.M), proc.stderr
  summary = proc.stderr.strip().splitlines()[-1]
  n = len(_tokens("def fibonacci(n):"))
  assert summary.startswith(f"prompt tokens: {n}, new tokens: 8, prefill:") and "decode:" in summary
  # The bfloat16 default model runs on the C++ kernels with bf16 activations, and says so, with
  # the kernels' variant for this machine (measured by the first run here, read from the tuning
  # file by every later one; the scalar kernels have none).
  assert re.search(r", kernels: ffi_bf16 \(\w+(\+amx)?, \d+ threads?, tuning (\S+ \((tuned|from) .+\)|"
                   r"default \(scalar kernels: nothing to tune\))\)$", summary), summary


def test_mapped_weights_are_prefaulted_and_say_so(tmp_path):
  proc = _run("--max_new_tokens=2", "--load_mode=mmap", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert re.search(r"^ftjax: pre-faulted the weights \(0\.0\d GB mapped\) in \d+\.\d s",
                   proc.stderr, re.M), proc.stderr
  proc = _run("--max_new_tokens=2", "--load_mode=mmap", "--noprefault", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert re.search(r"^ftjax: the weights \(0\.0\d GB\) are mapped from their files$",
                   proc.stderr, re.M), proc.stderr


@pytest.mark.parametrize("flag, message", [
    ("--top_p=1.5", "top_p must be in (0, 1]"),
    ("--temperature=-1", "temperature must be > 0"),
    ("--max_new_tokens=70000", "exceeds the context of 65536 tokens"),
    ("--model=/nonexistent/model", "does not exist"),
])
def test_bad_flags_are_clear_errors(tmp_path, flag, message):
  proc = _run(flag, cwd=tmp_path)
  assert proc.returncode != 0
  assert message in proc.stderr and "Traceback" not in proc.stderr
  assert proc.stdout == ""  # nothing printed before the error


@pytest.mark.parametrize("name", ["default", "default-hybrid"])
def test_shipped_models_are_their_trained_configurations(name):
  path = EMBEDDED_MODELS[name]
  f = ftw.FTWFile.open(path)  # verifies every checksum
  source = f.index["source"]
  assert source["kind"] == "trained" and source["trained"] and f.dtype.name == "bfloat16"
  with open(os.path.join(path, "train_log.json")) as fh:
    log = json.load(fh)
  fields = {fld.name for fld in dataclasses.fields(train.TrainConfig)}
  cfg = train.TrainConfig(**{k: v for k, v in log["config"].items() if k in fields})
  assert source["steps"] == cfg.steps
  expected = cfg.model_config()
  if "heldout_expert_overlap" not in log:
    # The first default model, trained before the chat tokens and the routing measurement
    # (balance weight 0.01): its tokenizer ends at <|endoftext|>. Retraining it with
    # python -m ftjax.tiny.train replaces it.
    assert name == "default" and cfg.balance_coef == 0.01
    expected = dataclasses.replace(expected, eos_token_ids=(0,))
  else:
    # What python -m ftjax.tiny.train [--arch=hybrid] writes, with real-model locality.
    assert cfg == train.CONFIGS[cfg.arch]
    assert log["heldout_expert_overlap"] >= 0.35
    if cfg.mtp_layers:  # the hybrid model's MTP head, trained on it (train_mtp)
      assert source["mtp"]["steps"] == cfg.mtp_steps == log["mtp"]["steps"]
      assert source["mtp"]["heldout_agreement"] == log["mtp"]["heldout_agreement"] > 0.7
    tok = load_tokenizer(path, f.config.vocab_size)
    for token, i in train.chat_token_ids(f.config.vocab_size).items():
      assert tok.encode(token) == [i]
  assert f.config == expected
  assert os.path.isfile(os.path.join(path, "tokenizer.json"))
  assert log["heldout_loss"] < log["unigram_heldout_loss"] - 1.0
  size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
  assert size < 25e6


# The greedy continuation on this machine (kernels=ffi: float32 accumulation of bf16 weights);
# a change means the model, the tokenizer or the numerics changed.
GOLDEN_PROMPT = "def add(a, b):"
GOLDEN_TEXT = '\n        """Return a list of a string.\n\n        The optional'


def test_default_model_greedy_output_is_deterministic():
  runs = [run_decode(prompt=GOLDEN_PROMPT, max_new_tokens=12, greedy=True, kernels="ffi",
                     out=io.StringIO(), log=io.StringIO()) for _ in range(2)]
  assert runs[0].generation.tokens == runs[1].generation.tokens
  assert len(runs[0].generation.tokens) == 12 and runs[0].tokenizer == "tokenizer.json"
  assert runs[0].text == GOLDEN_TEXT


@pytest.mark.parametrize("name", ["default", "default-hybrid"])
def test_embedded_model_cached_decode_equals_full_forward(name):
  model = ftjax.load(name)
  # Exact: bf16 activations could flip near-ties, and a bf16 KV cache can round a key
  # differently when one-token and many-token GEMMs differ in the last float32 bit.
  engine = ftjax.Engine(model, kernels="ffi", kv_dtype="float32")
  prompt = load_tokenizer(model.path, 0).encode("import os\n\n\ndef main():")
  new = engine.generate(prompt, 16, greedy=True)
  full = engine.forward_logits(prompt + new)
  assert [int(t) for t in full[len(prompt) - 1:-1].argmax(-1)] == new
  # and every cached decode step's logits equal the full forward's at that position
  state = engine.new_state(1, len(prompt) + len(new))
  state, logits = engine.step(state, jnp.asarray([prompt]), jnp.arange(len(prompt))[None],
                              last_only=True, fresh=True)
  steps = [np.asarray(logits)[0, -1]]
  for i, t in enumerate(new[:-1]):
    state, logits = engine.step(state, jnp.asarray([[t]]), jnp.asarray([[len(prompt) + i]]))
    steps.append(np.asarray(logits)[0, -1])
  tolerances.assert_close(np.stack(steps), full[len(prompt) - 1:-1], tolerances.F32, floor=1.0)


def test_decode_cli_runs_the_hybrid_model(tmp_path):
  proc = _run("--model=default-hybrid", "--max_new_tokens=8", "--greedy",
              "--prompt=def add(a, b):", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("def add(a, b):") and len(proc.stdout) > len("def add(a, b):")
  assert "embedded default model 'default-hybrid' (trained" in proc.stderr


def test_hf_dir_with_tokenizer_json(hf_checkpoints, tmp_path, monkeypatch):
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
  monkeypatch.setenv("FTJAX_CACHE_DIR", str(tmp_path / "cache"))
  _, src = hf_checkpoints["olmoe"]
  dst = tmp_path / "hf"
  os.makedirs(dst)
  for name in os.listdir(src):
    os.symlink(os.path.join(src, name), dst / name)
  vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", "foo", "bar"])}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(dst / "tokenizer.json"))
  out = io.StringIO()
  result = run_decode(str(dst), "hello world", max_new_tokens=5, greedy=True, out=out,
                      log=io.StringIO())
  assert result.tokenizer == "tokenizer.json" and result.generation.prompt_tokens == 2
  assert len(result.generation.tokens) == 5
  assert os.path.isfile(os.path.join(result.model_path, "tokenizer.json"))


def test_trace_out_writes_a_routing_trace(tmp_path):
  from ftjax.research.traces import Trace  # noqa: PLC0415
  path = tmp_path / "trace.npz"
  proc = _run("--max_new_tokens=6", "--greedy", f"--trace_out={path}", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  trace = Trace.load(path)
  n = len(_tokens("def fibonacci(n):"))
  c = train.TrainConfig()
  assert trace.num_steps == n + 5
  assert (trace.num_layers, trace.num_experts, trace.top_k) == (c.num_layers, c.num_experts,
                                                                 c.top_k)
  assert trace.phase.tolist() == [0] * n + [1] * 5


def test_embedded_models_load_by_name():
  model = ftjax.load("default")
  assert model.path == DEFAULT_MODEL_DIR and model.config.model_type == "qwen3_moe"
  with pytest.raises(FileNotFoundError, match="embedded models: default, default-hybrid"):
    ftjax.load("no-such-model")
