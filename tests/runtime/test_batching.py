"""Continuous batching in the executor's decode loop: sequences that decode together in one
batch (joining and leaving between chunks, each with its own prompt, length, sampling and
stops) get exactly the tokens each gets alone, for every kind of cache policy state and for
attention and hybrid families; sessions generate in a batch and go on afterwards as alone."""

import dataclasses

import jax
import numpy as np
import pytest

import ftjax
from ftjax.runtime import model as model_lib
from ftjax.runtime.executor import Feed, Generation
from ftjax.runtime.sampling import Sampling

CHUNK = 3  # small, so that joins, halts and leaves fall between many chunks
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [7, 7, 2], list(range(5, 45)), [11, 13, 17, 19, 23]]
NEW = [9, 14, 6, 12]
SAMPLING = [dict(greedy=True), dict(greedy=False, temperature=0.8, seed=3),
            dict(greedy=True), dict(greedy=False, temperature=1.2, top_p=0.9, top_k=5, seed=1)]


def _sharp(config, seed):
  model = model_lib.random_model(config, seed=seed)
  params = jax.tree.map(lambda x: x * 8.0, model.params)  # sharp routing, distinct logits
  return dataclasses.replace(model, params=params, bank=model.bank * 8.0)


@pytest.fixture(scope="module")
def models(tiny_config, tiny_hybrid_config):
  return {"attention": _sharp(tiny_config, 5), "hybrid": _sharp(tiny_hybrid_config, 6)}


def _options(model, policy, size):
  if policy is None:
    return {}
  total = model.config.num_moe_layers * model.config.num_experts
  slots = {"0": 0, "1/3": total // 3, "1": total}[size]
  hot = np.arange(total)[::-1].reshape(model.config.num_moe_layers, -1)
  return dict(cache_slots=slots, policy=policy, bandwidths=(12.0, 24.0), hot_experts=hot)


class Staggered(Feed):
  """Gives its generations to the loop one at a time, each after ``gap`` loop calls, so that
  they join a batch whose other rows are mid-stream."""

  def __init__(self, generations, gap=2):
    self.queue, self.gap, self.calls = list(generations), gap, 0

  def ready(self, free):
    self.calls += 1
    if not self.queue or self.calls % self.gap:
      return []
    return [self.queue.pop(0)]

  def pending(self):
    return bool(self.queue) and (self.calls + 1) % self.gap == 0

  def work(self):
    return bool(self.queue)


def _generation(engine, prompt, new, sampling, stops=()):
  read = engine.executor.extend(engine.new_state(1, len(prompt) + new), prompt, start=0)
  return Generation(state=read.state, logits=read.logits, max_new=new,
                    sampling=Sampling.make(**sampling), stops=stops,
                    on_chunk=lambda tokens, halted, layers: not halted)


# One case per kind of state the loop carries (recency, LRFU scores with the layer cycle,
# free-slot fills, a preloaded cache) with a third of the experts cached, empty and full
# caches for the two fill rules, and no cache.
_CASES = [("attention", None, "0"), ("hybrid", None, "0")] + [
    ("attention", p, "1/3") for p in ("freetoken", "freetoken_lrfu_cycle", "freetoken_free",
                                      "static_hot")] + [
    ("hybrid", "lru_fill", "1/3"), ("hybrid", "freetoken", "0"), ("attention", "lru_fill", "1")]


@pytest.mark.parametrize("family,policy,size", _CASES,
                         ids=[f"{f}-{p}-{s}" for f, p, s in _CASES])
def test_batched_sequences_equal_each_alone(models, family, policy, size):
  model = models[family]
  engine = ftjax.Engine(model, kernels="ffi", decode_chunk=CHUNK,
                        **_options(model, policy, size))
  alone = [engine.generate(p, n, **s) for p, n, s in zip(PROMPTS, NEW, SAMPLING)]
  assert all(len(set(a)) > 1 for a in alone)  # not a degenerate model
  # Sequence 1 stops at a token it samples mid-way (its stop ids, as a request's end token).
  stops = [(), (alone[1][5],), (), ()]
  want = [a[:a.index(st[0]) + 1] if st else a for a, st in zip(alone, stops)]
  gens = [_generation(engine, p, n, s, st) for p, n, s, st in zip(PROMPTS, NEW, SAMPLING, stops)]
  batch = engine.executor.batch(4)
  engine.executor.join(batch, gens[0])
  engine.executor.run(batch, Staggered(gens[1:]))
  assert [g.tokens for g in gens] == want
  assert batch.free() == 4
  # Each left with its state: it has read its context and every new token but the last.
  for g, p in zip(gens, PROMPTS):
    assert int(g.state.length) == len(p) + len(g.tokens) - 1


def test_a_full_batch_takes_the_next_sequence_when_one_leaves(models):
  """Six sequences through a batch of two rows: each joins when a row frees up."""
  model = models["attention"]
  engine = ftjax.Engine(model, kernels="ffi", decode_chunk=CHUNK)
  prompts = PROMPTS + [[2, 3], [5, 8, 13]]
  new = NEW + [5, 7]
  samplings = SAMPLING + [dict(greedy=True), dict(greedy=False, temperature=0.9, seed=9)]
  alone = [engine.generate(p, n, **s) for p, n, s in zip(prompts, new, samplings)]
  gens = [_generation(engine, p, n, s) for p, n, s in zip(prompts, new, samplings)]
  batch = engine.executor.batch(2)
  engine.executor.run(batch, Staggered(gens, gap=1))
  assert [g.tokens for g in gens] == alone


def test_sessions_generate_in_one_batch_and_go_on_alone(models):
  """Two sessions of the hybrid family (anchors taken at pause tokens while in the batch)
  decode together; their next turns equal those of sessions that ran alone."""
  model = models["hybrid"]
  engine = ftjax.Engine(model, kernels="ffi", decode_chunk=CHUNK)
  reference = ftjax.Engine(model, kernels="ffi", decode_chunk=CHUNK)
  pause = [5, 9, 17]  # boundary tokens: the row halts at each, the session snapshots, resumes

  def turns(engine, batched):
    sessions = [ftjax.Session(engine, anchor_tokens=pause) for _ in range(2)]
    for s, p in zip(sessions, PROMPTS[:2]):
      s.set_context(p)
    if batched:
      gens = [s.generation(n) for s, n in zip(sessions, (16, 12))]
      batch = engine.executor.batch(2)
      engine.executor.run(batch, Staggered(gens, gap=1))
      first = [list(g.tokens) for g in gens]
    else:
      first = [s.generate(n) for s, n in zip(sessions, (16, 12))]
    second = []
    for s in sessions:
      s.set_context(s.tokens + [2, 5, 7])
      second.append(s.generate(6))
    return first, second, [s.stats()["anchors"] for s in sessions]

  got, want = turns(engine, True), turns(reference, False)
  assert got == want
  assert sum(got[2]) > 0  # anchors were taken


def test_a_session_in_the_decode_loop_refuses_a_new_context(models):
  engine = ftjax.Engine(models["attention"], kernels="ffi", decode_chunk=CHUNK)
  session = ftjax.Session(engine)
  session.set_context(PROMPTS[0])
  generation = session.generation(4)
  with pytest.raises(RuntimeError, match="is generating"):
    session.set_context(PROMPTS[1])
  engine.executor.run_one(generation)
  session.set_context(PROMPTS[1])


def test_a_device_budget_gives_the_batch_rows_and_takes_them_back(models):
  """With one device budget, the expert cache gets what the decode states leave
  (ftjax.runtime.budget): it gives up slots while a batch's rows are held and takes them back
  when the last sequence leaves; outputs equal the dense path's (lru_fill is exact) across the
  resizes."""
  model = models["attention"]
  probe = ftjax.Engine(model, kernels="ffi", device_budget_bytes=0, policy="lru_fill")
  cap = probe.kv_capacities[0]
  total = probe.total_experts
  # Every expert beside the two sessions' own states; fewer beside the batch's four rows.
  budget = 2 * probe.state_bytes(1, cap) + total * probe.slot_bytes
  assert 2 * probe.state_bytes(1, cap) > probe.slot_bytes
  engine = ftjax.Engine(model, kernels="ffi", decode_chunk=CHUNK, device_budget_bytes=budget,
                        policy="lru_fill")
  reference = ftjax.Engine(model, kernels="ffi", decode_chunk=CHUNK)
  alone = [reference.generate(p, n) for p, n in zip(PROMPTS[:2], NEW[:2])]

  def slots_for(state):
    return min(total, max(0, (budget - state) // engine.slot_bytes))

  seen = []  # (state bytes, slots) after each chunk

  def watched(inner):
    def on_chunk(tokens, halted, layers):
      seen.append((engine.memory.state_bytes, int(engine.cache.limit)))
      return inner(tokens, halted, layers)
    return on_chunk

  sessions = [ftjax.Session(engine) for _ in range(2)]
  for s, p in zip(sessions, PROMPTS[:2]):
    s.set_context(p)
  held = engine.memory.state_bytes
  assert held == 2 * engine.state_bytes(1, cap)
  assert int(engine.cache.limit) == slots_for(held) == total  # room for every expert
  gens = [s.generation(n) for s, n in zip(sessions, NEW[:2])]
  for g in gens:
    g.on_chunk = watched(g.on_chunk)
  batch = engine.executor.batch(4)
  engine.executor.run(batch, Staggered(gens, gap=1))
  assert [list(g.tokens) for g in gens] == alone
  # While in the batch, the sessions' rows were the batch's (4 rows held), not their own.
  assert all(slots == slots_for(state) for state, slots in seen)
  assert any(state >= engine.state_bytes(4, cap) for state, _ in seen)
  assert min(slots for _, slots in seen) < total
  # All left: the batch's rows went back to the cache; the sessions hold their own again.
  assert batch.state is None
  assert engine.memory.state_bytes == 2 * engine.state_bytes(1, cap)
  assert int(engine.cache.limit) == total
  assert engine.memory.last_resize["slots"] > engine.memory.last_resize["slots_before"]
  for s in sessions:
    assert s.stats()["turns"][-1]["decode"]["steps"] > 0
    s.close()
  assert engine.memory.state_bytes == 0
