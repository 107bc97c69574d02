"""ftjax.Session: after every kind of edit a client makes, the context's logits and greedy
continuation equal a fresh engine's full prefill; KV truncation and anchors are reused where
they are valid and nowhere else; the anchor budget and bad input behave as documented."""

import dataclasses

import numpy as np
import pytest

import ftjax
from ftjax.runtime import model as model_lib
from ftjax.runtime.kv import ContextLengthError

import tolerances
from conftest import scaled_params

NEW = 5  # greedy tokens compared after each context


@pytest.fixture(scope="module")
def models(hybrid_checkpoints, tiny_config, tmp_path_factory):
  """Both hybrid families (converted in float32 from random transformers models) and one
  attention-only family (a random qwen3_moe with sharpened weights)."""
  out = {}
  for name in ("qwen3_next", "qwen3_5_moe_text"):
    _, path = hybrid_checkpoints[name]
    ftw_dir = ftjax.convert_hf(path, tmp_path_factory.mktemp(name) / "ftw", dtype="float32",
                               show_progress=False)
    out[name] = ftjax.load(ftw_dir)
  attn = model_lib.random_model(dataclasses.replace(tiny_config, max_position_embeddings=512),
                                seed=3)
  out["qwen3_moe"] = scaled_params(attn, 4.0)
  return out


class Chat:
  """Token-level stand-ins for Qwen's chat tokens at the top of a small vocabulary."""

  def __init__(self, vocab: int, seed: int = 0):
    (self.TURN, self.THINK, self.END_THINK, self.CALL, self.END_CALL, self.RESP, self.END_RESP,
     self.END) = range(vocab - 1, vocab - 9, -1)
    self.boundaries = [self.TURN, self.THINK, self.END_THINK, self.CALL, self.END_CALL,
                       self.RESP, self.END_RESP]
    self.rng = np.random.default_rng(seed)
    self.content_vocab = vocab - 9

  def text(self, n):
    return self.rng.integers(0, self.content_vocab, n).tolist()


def _check_exact(engine, session, ids, what):
  result = session.set_context(ids)
  ref = engine.forward_logits(ids)[-1]
  tolerances.assert_close(result.last_logits, ref, tolerances.F32, floor=1.0, what=what)
  assert result.reused_tokens + result.prefilled_tokens == len(ids)
  assert session.tokens == list(ids)
  return result


def _check_continuation(engine, session, ids, what):
  got = session.generate(NEW)
  assert got == engine.generate(ids, NEW), what
  assert session.tokens == list(ids) + got
  return got


# Each way of taking anchors on one hybrid family (both families' recurrent layers are the
# same code; their differences are test_hybrid_parity's), plus the attention-only family (CI
# time).
@pytest.mark.parametrize("name,mode,chunk", [
    ("qwen3_next", "inside", 2048), ("qwen3_5_moe_text", "split", 2048),
    ("qwen3_moe", "inside", 2048),
    # Segments longer than the prefill chunk are read chunk by chunk, anchors in each.
    ("qwen3_next", "inside", 7), ("qwen3_moe", "inside", 7)])
def test_every_edit_is_exact_and_reuses_what_is_valid(models, name, mode, chunk):
  """Both ways of taking anchors in a prefill (from the chunked form's intermediate states,
  or by splitting the prefill at boundaries) give the same reuse and exact logits."""
  model = models[name]
  hybrid = "linear_attention" in model.config.layer_types
  engine = ftjax.Engine(model, kernels="ffi", prefill_chunk=chunk)
  c = Chat(model.config.vocab_size)
  session = ftjax.Session(engine, anchor_tokens=c.boundaries, anchor_prefill=mode)
  assert session.anchoring == hybrid

  system = [c.TURN, 1, 2] + c.text(10) + [c.END]
  user1 = [c.TURN, 3] + c.text(12) + [c.END]
  think = [c.THINK] + c.text(9) + [c.END_THINK]
  assistant1 = [c.TURN, 4] + think + c.text(5) + [c.CALL] + c.text(6) + [c.END_CALL, c.END]
  tool = [c.TURN, 5, c.RESP] + c.text(8) + [c.END_RESP, c.END]
  prompt = [c.TURN, 4]

  # 1. The first turn: nothing to reuse.
  ctx = system + user1 + assistant1 + tool + prompt
  r = _check_exact(engine, session, ctx, f"{name} first")
  assert r.reused_tokens == 0
  reply = _check_continuation(engine, session, ctx, f"{name} first")

  # 2. Append: the reply, the end of the turn, a new user turn.
  ctx = ctx + reply + [c.END, c.TURN, 3] + c.text(7) + [c.END] + prompt
  r = _check_exact(engine, session, ctx, f"{name} append")
  # Everything read so far is reused (the last reply token was never read).
  assert r.reused_tokens == len(system + user1 + assistant1 + tool + prompt) + NEW - 1
  _check_continuation(engine, session, ctx, f"{name} append")

  # 3. Drop the <think> block of an earlier turn.
  think_at = len(system + user1) + 2
  assert ctx[think_at] == c.THINK
  ctx = ctx[:think_at] + ctx[think_at + len(think):]
  r = _check_exact(engine, session, ctx, f"{name} drop think")
  assert r.reused_tokens == think_at
  assert r.anchor_position == (think_at if hybrid else None)
  _check_continuation(engine, session, ctx, f"{name} drop think")

  # 4. Rewrite a tool result.
  resp_at = ctx.index(c.RESP)
  ctx = ctx[:resp_at + 1] + c.text(8) + ctx[resp_at + 9:]
  r = _check_exact(engine, session, ctx, f"{name} tool result")
  if hybrid:  # the anchor at <tool_response>
    assert r.reused_tokens == resp_at and r.anchor_position == resp_at
  else:  # the KV cache up to the first changed token
    assert r.reused_tokens >= resp_at + 1 and r.anchor_position is None
  _check_continuation(engine, session, ctx, f"{name} tool result")

  # 5. Truncate the last turn.
  ctx = ctx[:-4]
  r = _check_exact(engine, session, ctx, f"{name} truncate")
  if hybrid:  # the nearest anchor before the cut
    assert r.anchor_position is not None and r.reused_tokens == r.anchor_position
  else:
    assert r.reused_tokens == len(ctx) - 1  # one token is always read to give logits
  _check_continuation(engine, session, ctx, f"{name} truncate")

  # 6. An edit at token 0: nothing is reusable.
  ctx = [c.END] + ctx[1:]
  r = _check_exact(engine, session, ctx, f"{name} token 0")
  assert r.reused_tokens == 0 and r.anchor_position is None
  _check_continuation(engine, session, ctx, f"{name} token 0")

  # 7. An edit inside the prompt before the first anchor (the system text).
  ctx = ctx[:6] + [(ctx[6] + 1) % c.content_vocab] + ctx[7:]
  r = _check_exact(engine, session, ctx, f"{name} before the first anchor")
  assert r.reused_tokens == (0 if hybrid else 6)
  _check_continuation(engine, session, ctx, f"{name} before the first anchor")

  stats = session.stats()
  assert len(stats["turns"]) == 7
  assert stats["prefilled_tokens"] + stats["reused_tokens"] == sum(
      t["context_tokens"] for t in stats["turns"])
  if hybrid:
    assert stats["anchors"] > 0 and stats["anchor_restores"] == 3  # steps 3, 4 and 5
  else:
    assert stats["anchors"] == 0


def test_xla_path_is_exact_too(models):
  model = models["qwen3_5_moe_text"]
  engine = ftjax.Engine(model, kernels="xla")
  c = Chat(model.config.vocab_size, seed=1)
  session = ftjax.Session(engine, anchor_tokens=c.boundaries)
  think = [c.THINK] + c.text(6) + [c.END_THINK]
  ctx = [c.TURN] + c.text(8) + [c.END, c.TURN, 4] + think + c.text(5) + [c.END, c.TURN, 3]
  _check_exact(engine, session, ctx, "xla first")
  _check_continuation(engine, session, ctx, "xla first")
  ctx = ctx[:12] + ctx[12 + len(think):]
  r = _check_exact(engine, session, ctx, "xla drop think")
  assert r.anchor_position == 12
  _check_continuation(engine, session, ctx, "xla drop think")


def test_anchor_taken_when_decode_samples_a_boundary(models):
  model = models["qwen3_next"]
  engine = ftjax.Engine(model, kernels="ffi", decode_chunk=4)
  c = Chat(model.config.vocab_size, seed=2)
  ctx = [c.TURN] + c.text(20)
  ref = engine.generate(ctx, 12)
  i = next(i for i in range(3, 12) if ref[i] not in ref[:i] + ctx)  # first occurrence
  session = ftjax.Session(engine, anchor_tokens=[ref[i]])
  session.set_context(ctx)
  assert session.generate(12) == ref  # pausing at the boundary changes no token
  position = len(ctx) + i
  assert position in [a["position"] for a in session.stats()["anchor_list"]]
  edited = ctx + ref[:i] + c.text(3)  # an edit starting at the sampled boundary
  r = _check_exact(engine, session, edited, "edit at a generated boundary")
  assert r.anchor_position == position and r.reused_tokens == position


def test_anchor_budget_zero_reuses_only_appends(models):
  model = models["qwen3_next"]
  engine = ftjax.Engine(model, kernels="ffi")
  c = Chat(model.config.vocab_size, seed=3)
  session = ftjax.Session(engine, anchor_tokens=c.boundaries, anchor_budget_bytes=0)
  assert not session.anchoring
  think = [c.THINK] + c.text(6) + [c.END_THINK]
  ctx = [c.TURN] + c.text(8) + [c.TURN, 4] + think + c.text(4)
  _check_exact(engine, session, ctx, "budget 0 first")
  r = _check_exact(engine, session, ctx + c.text(3), "budget 0 append")
  assert r.reused_tokens == len(ctx)  # the state itself is the restore point of an append
  ctx = ctx[:11] + ctx[11 + len(think):]
  r = _check_exact(engine, session, ctx, "budget 0 edit")
  assert r.reused_tokens == 0 and r.anchor_position is None
  assert session.stats()["anchors"] == 0


def test_eviction_keeps_the_newest_anchor_of_each_turn(models):
  model = models["qwen3_next"]
  engine = ftjax.Engine(model, kernels="ffi")
  c = Chat(model.config.vocab_size, seed=4)
  probe = ftjax.Session(engine, anchor_tokens=c.boundaries)
  session = ftjax.Session(engine, anchor_tokens=c.boundaries, turn_token=c.TURN,
                          anchor_budget_bytes=3 * probe.anchor_bytes)
  assert probe.turn_id is None  # no tokenizer: one turn for every anchor
  x = c.text(6)
  # Anchors in taking order: 2, 4, 6 (turn 1), 8 (turn 2), then 10 (the end, turn 2).
  ctx = [c.TURN, x[0], c.THINK, x[1], c.END_THINK, x[2], c.CALL, x[3], c.TURN, x[4]]
  session.set_context(ctx)
  # 8 evicted 2 (not the newest of turn 1); the end anchor evicted 4 (turn 1's newest is 6,
  # turn 2's is 10, so 4 and 8 were candidates and 4 is older).
  assert [a["position"] for a in session.stats()["anchor_list"]] == [6, 8, 10]
  assert session.stats()["anchor_bytes"] <= 3 * probe.anchor_bytes


def test_embedded_hybrid_model_anchors_at_chat_tokens():
  model = ftjax.load("default-hybrid")
  # A float32 KV cache: with the bfloat16 default, a float32-ulp difference in a key between
  # two ways of splitting the prefill can flip its bfloat16 rounding (2^-9), more than the
  # float32 tolerance this exactness check uses.
  engine = ftjax.Engine(model, kernels="ffi", kv_dtype="float32")
  session = ftjax.Session(engine)
  assert session.anchoring
  from ftjax.runtime.tokenizer import load_tokenizer  # noqa: PLC0415
  tok = load_tokenizer(model.path, model.config.vocab_size)
  names = ["<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
           "<tool_response>", "</tool_response>"]
  assert sorted(session.anchor_ids) == sorted(tok.token_id(n) for n in names)
  turn1 = ("<|im_start|>user\nsort a list<|im_end|>\n<|im_start|>assistant\n<think>\nsorted() "
           "</think>\n\nUse sorted(x).<|im_end|>\n")
  prompt = "<|im_start|>user\nand reversed?<|im_end|>\n<|im_start|>assistant\n"
  ids = tok.encode(turn1 + prompt)
  _check_exact(engine, session, ids, "default-hybrid first")
  boundaries = [p for p, t in enumerate(ids) if t in session.anchor_ids and p > 0]
  held = [a["position"] for a in session.stats()["anchor_list"]]
  assert held == boundaries + [len(ids)]
  dropped = tok.encode(turn1.replace("<think>\nsorted() </think>\n\n", "") + prompt)
  r = _check_exact(engine, session, dropped, "default-hybrid drop think")
  assert r.anchor_position == ids.index(tok.token_id("<think>"))
  assert ftjax.Session(ftjax.Engine(ftjax.load("default"), kernels="ffi")).anchoring is False


def test_with_an_expert_cache_tokens_equal_the_dense_path(models):
  model = models["qwen3_5_moe_text"]
  dense = ftjax.Engine(model, kernels="ffi")
  cached = ftjax.Engine(model, kernels="ffi", cache_slots=5, policy="lru_fill")
  c = Chat(model.config.vocab_size, seed=5)
  session = ftjax.Session(cached, anchor_tokens=c.boundaries)
  ctx = [c.TURN] + c.text(10) + [c.THINK] + c.text(5)
  _check_exact(dense, session, ctx, "cached first")
  _check_continuation(dense, session, ctx, "cached first")
  ctx = ctx[:11] + c.text(4)
  r = _check_exact(dense, session, ctx, "cached edit")
  assert r.anchor_position == 11
  assert cached.stats()["steps"] > 0


def test_bad_input_gets_clear_errors(models):
  model = models["qwen3_5_moe_text"]
  vocab = model.config.vocab_size
  engine = ftjax.Engine(model, kernels="ffi", max_seq_len=32)
  with pytest.raises(TypeError, match="needs an ftjax.Engine"):
    ftjax.Session(model)
  with pytest.raises(ValueError, match="anchor_budget_bytes"):
    ftjax.Session(engine, anchor_budget_bytes=-1)
  with pytest.raises(ValueError, match="anchor_prefill must be 'inside' or 'split'"):
    ftjax.Session(engine, anchor_prefill="chunks")
  with pytest.raises(ValueError, match="no tokenizer.json"):
    ftjax.Session(engine, anchor_tokens=["<think>"])
  with pytest.raises(ValueError, match=r"anchor tokens must be .* ids in \[0, 96\)"):
    ftjax.Session(engine, anchor_tokens=[vocab])
  session = ftjax.Session(engine, anchor_tokens=[vocab - 1])
  with pytest.raises(ValueError, match="call set_context"):
    session.generate(3)
  with pytest.raises(ValueError, match=r"token ids must be in \[0, 96\)"):
    session.set_context([1, 2, vocab])
  with pytest.raises(ValueError, match="flat sequence of ints"):
    session.set_context([1.5, 2.0])
  with pytest.raises(ValueError, match="flat sequence of ints"):
    session.set_context([[1, 2]])
  with pytest.raises(ValueError, match="prompt is empty"):
    session.set_context([])
  with pytest.raises(ContextLengthError, match="exceeds the context of 32 tokens"):
    session.set_context(list(range(40)))
  session.set_context([1, 2, 3])
  with pytest.raises(ContextLengthError, match="exceeds the context of 32 tokens"):
    session.generate(40)
  with pytest.raises(ValueError, match="max_new_tokens"):
    session.generate(-1)
  # A failed call leaves the session usable and exact.
  r = _check_exact(engine, session, [1, 2, 3, 4], "after errors")
  assert r.reused_tokens == 3
