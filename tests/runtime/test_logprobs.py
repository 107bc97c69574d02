"""Log-probabilities made by the engine's own programs: a prompt's (``Engine.prompt_logprobs``,
``Session.set_context(logprobs=True)``: the prefill's chunks) and generated tokens'
(``generate_timed(logprobs=True)``, the decode loop, in a batch beside rows that want none),
against a float64 log-softmax of the dense teacher-forced logits (``forward_logits``)."""

import numpy as np
import pytest

import ftjax
from ftjax.runtime import model as model_lib
from ftjax.runtime.executor import Generation
from ftjax.runtime.programs import TOP_LOGPROBS
from ftjax.runtime.sampling import Sampling

import tolerances
from conftest import scaled_params


@pytest.fixture(scope="module")
def models(tiny_config, tiny_hybrid_config):
  # Scaled as test_chunked_prefill's: routing not near-uniform, logits not flat.
  return {"attention": scaled_params(model_lib.random_model(tiny_config, seed=5), 4.0),
          "hybrid": scaled_params(model_lib.random_model(tiny_hybrid_config, seed=6), 4.0)}


class Reference:
  """The float64 log-softmax of logits [n, V] (the dense forward's, float32), and their
  scale: the engine's float32 logits differ from them by ``F32`` of it, and a log-prob (a
  logit less the log-sum-exp) by twice that."""

  def __init__(self, logits):
    z = np.asarray(logits, np.float64)
    self.scale = max(1.0, float(np.abs(z).max()))
    z = z - z.max(-1, keepdims=True)
    self.logprobs = z - np.log(np.exp(z).sum(-1, keepdims=True))


def _check(entries, ids, ref: Reference, what):
  """``entries[i]`` is the log-prob of ``ids[i]`` under ``ref.logprobs[i]``, with the most
  probable tokens (ties aside) and their log-probs."""
  reference, tol = ref.logprobs, 2 * tolerances.F32
  got = np.array([e.logprob for e in entries])
  want = reference[np.arange(len(ids)), ids]
  tolerances.assert_close(got, want, tol, floor=ref.scale, what=what)
  k = min(TOP_LOGPROBS, reference.shape[-1])
  top = np.stack([e.top for e in entries])
  tolerances.assert_close(top, -np.sort(-reference, axis=-1)[:, :k], tol, floor=ref.scale,
                          what=what + " (top)")
  picked = np.take_along_axis(reference, np.stack([e.top_ids for e in entries]), axis=-1)
  tolerances.assert_close(picked, top, tol, floor=ref.scale, what=what + " (top ids)")
  assert [e.token for e in entries] == [int(t) for t in ids]


@pytest.mark.parametrize("family", ["attention", "hybrid"])
@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_prompt_logprobs_equal_the_dense_forward(models, family, kernels):
  model = models[family]
  engine = ftjax.Engine(model, kernels=kernels, prefill_chunk=16)
  ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 70)  # 5 chunks
  reference = Reference(engine.forward_logits(ids)[:-1])
  entries = engine.prompt_logprobs(ids)
  assert len(entries) == len(ids) and entries[0] is None
  _check(entries[1:], ids[1:], reference, f"{family} {kernels} prompt")


def test_session_logprobs_read_the_whole_context_again(models):
  model = models["hybrid"]
  engine = ftjax.Engine(model, prefill_chunk=16)
  ids = np.random.default_rng(2).integers(0, model.config.vocab_size, 40).tolist()
  reference = Reference(engine.forward_logits(ids)[:-1])
  session = ftjax.Session(engine)
  first = session.set_context(ids[:30])
  assert first.logprobs is None
  again = session.set_context(ids, logprobs=True)
  assert again.reused_tokens == 0 and again.prefilled_tokens == len(ids)
  assert again.logprobs[0] is None
  _check(again.logprobs[1:], ids[1:], reference, "session")
  # The session goes on from the context it read: greedy equals a fresh engine's.
  assert session.generate(6) == engine.generate(ids, 6)


@pytest.mark.parametrize("family", ["attention", "hybrid"])
def test_generated_logprobs_equal_the_dense_forward(models, family):
  model = models[family]
  engine = ftjax.Engine(model, decode_chunk=3)
  prompt = [3, 1, 4, 1, 5, 9, 2]
  for sampling in (dict(greedy=True), dict(greedy=False, temperature=1.3, seed=4)):
    result = engine.generate_timed(prompt, 10, logprobs=True, **sampling)
    assert len(result.logprobs) == len(result.tokens) == 10
    seq = prompt + result.tokens
    reference = Reference(engine.forward_logits(seq)[len(prompt) - 1:-1])
    _check(result.logprobs, result.tokens, reference, f"{family} {sampling}")
    if sampling["greedy"]:
      assert all(e.top_ids[0] == e.token for e in result.logprobs)
    assert engine.generate_timed(prompt, 10, **sampling).tokens == result.tokens


def test_rows_that_want_logprobs_beside_rows_that_do_not(models):
  """In one decode batch, only the rows that ask get log-probs, each its own, and every
  row's tokens are those it gets alone."""
  model = models["attention"]
  engine = ftjax.Engine(model, decode_chunk=3)
  prompts = [[3, 1, 4, 1, 5], [7, 7, 2], list(range(5, 25))]
  want = [True, False, True]
  gens = []
  for prompt, wanted in zip(prompts, want):
    read = engine.executor.extend(engine.new_state(1, len(prompt) + 8), prompt, start=0)
    gens.append(Generation(state=read.state, logits=read.logits, max_new=8,
                           sampling=Sampling.make(greedy=True),
                           on_chunk=lambda tokens, halted, layers: not halted,
                           logprobs=[] if wanted else None))
  batch = engine.executor.batch(3)
  for gen in gens:
    engine.executor.join(batch, gen)
  engine.executor.run(batch)
  for prompt, wanted, gen in zip(prompts, want, gens):
    assert gen.tokens == engine.generate(prompt, 8)
    if not wanted:
      assert gen.logprobs is None
      continue
    reference = Reference(engine.forward_logits(prompt + gen.tokens)[len(prompt) - 1:-1])
    _check(gen.logprobs, gen.tokens, reference, "batch row")


def test_targets_must_match_the_tokens(models):
  engine = ftjax.Engine(models["attention"])
  with pytest.raises(ValueError, match="one token per token read"):
    engine.executor.extend(engine.new_state(1, 8), [1, 2, 3], start=0, targets=[2, 3])
