"""Synthetic routing traces, calibrated to published Qwen3-30B-A3B routing statistics.

A ``RoutingModel`` describes, per MoE layer, how a router picks its ``top_k`` experts one
token (step) after another; ``generate`` samples a ``ftjax.research.traces.Trace`` from it that the
sweep replays like a captured one::

  from ftjax.research import synthetic, sweep
  trace = synthetic.generate(synthetic.qwen3_30b_a3b(), 2000, seed=0, prefill_steps=100)
  sweep.replay(trace, "freetoken", cache_slots=2273, bandwidths=(52.7, 77.3)).miss_rate

The process, per layer ``l`` and step ``t`` (all layers are independent):

1. **Temporal reuse.** Each expert of step ``t-1`` is routed again at ``t`` with probability
   ``reuse[l]`` (``prefill_reuse[l]`` at prefill steps), independently. The experts that are
   not kept are not drawn again at ``t`` (unless too few experts remain), so the expected
   share of ``top_k`` that consecutive steps have in common is exactly ``reuse[l]``.
2. **New experts** fill the remaining routes, drawn without replacement from the mixture
   ``(1 - working_set[l]) * popularity + working_set[l] * recent``:

   * ``popularity``: a Zipf law over a fixed random order of the experts,
     ``p(rank r) ∝ (r + 1/2) ** -skew[l]``; which expert has which rank is drawn once per
     layer from ``layout_seed``, so traces of different seeds share their popular experts
     (as different prompts on one model do).
   * ``recent``: the short-term working set, each expert weighted by
     ``sum_d working_set_decay[l] ** d`` over the earlier steps ``t - 1 - d`` that routed it
     (those of step ``t - 1`` are excluded as above), so a recalled expert was last routed
     a few steps ago, on the order of ``1 / (1 - decay)``.
3. **Phase shift.** At prefill steps the popularity is
   ``(1 - prefill_shift[l]) * popularity + prefill_shift[l] * other``, ``other`` being the same
   Zipf law over a second random order: prompts prefer partly different experts than
   generated text. The working set carries over from prefill into decode.
4. **Drift between tasks.** The decode steps form tasks (prompts) of ``task_steps`` steps
   (0: one task). Each task ranks the experts by its own order: the layer's order with every
   rank moved by Gaussian noise of ``drift[l] · E`` ranks, then re-ranked. The task's law is
   the same Zipf law over that order, so within a task every statistic above is unchanged,
   while the popular set moves between tasks (and between seeds, which draw other tasks): a
   routing profile counted on other tasks pins partly the wrong experts. The prefill steps
   belong to the first task. Task orders come from their own random stream, so ``drift = 0``
   reproduces the traces of a model without tasks exactly.
5. **Weights**: a symmetric Dirichlet(``weight_concentration``) draw per route set, sorted
   in descending order as a router's top-k are (so they are positive and sum to 1).

``qwen3_30b_a3b()`` holds the calibrated parameters (``docs/synthetic.md`` has the targets
and the achieved values); ``scaled`` carries a model to other shapes; ``fit_skew`` re-fits the
popularity skew to per-layer top-share targets.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import numpy as np

from ftjax.research import routing_stats
from ftjax.research.traces import Trace
from ftjax.utils.progress import Progress

PREFILL, DECODE = routing_stats.PREFILL, routing_stats.DECODE

_PER_LAYER = ("skew", "reuse", "working_set", "working_set_decay", "prefill_reuse",
              "prefill_shift", "drift")


@dataclasses.dataclass(frozen=True)
class RoutingModel:
  """Parameters of the synthetic router; per-layer values are tuples of ``num_layers`` floats
  (a single number is broadcast to every layer).

  Attributes:
    num_layers: MoE layers L.
    num_experts: routed experts per layer E.
    top_k: experts routed per token and layer K (``1 <= K <= E``).
    skew: Zipf exponent of each layer's expert popularity (>= 0; 0 is uniform).
    reuse: probability that an expert of decode step t is routed again at t+1, in [0, 1]:
      the expected consecutive-step overlap, as a fraction of K.
    working_set: probability in [0, 1] that a new (not reused) expert comes from the
      recently routed experts rather than from the popularity law.
    working_set_decay: per-step decay in [0, 1) of an expert's weight in the working set.
    prefill_reuse: ``reuse`` at prefill steps.
    prefill_shift: share in [0, 1] of the prefill popularity taken from a second, independent
      expert order (0: prefill prefers the same experts as decode).
    weight_concentration: Dirichlet concentration (> 0) of the routing weights; small values
      give one dominant weight, large values near-equal weights.
    layout_seed: fixes which experts are popular (the random expert orders), independent of
      the seed of ``generate``.
    drift: per layer, >= 0: how far each task's expert order moves from the layer's order,
      in units of E ranks of Gaussian noise (0: every task prefers the same experts).
    task_steps: decode steps per task (prompt); 0 makes the whole trace one task.
  """
  num_layers: int
  num_experts: int
  top_k: int
  skew: tuple[float, ...]
  reuse: tuple[float, ...]
  working_set: tuple[float, ...]
  working_set_decay: tuple[float, ...]
  prefill_reuse: tuple[float, ...]
  prefill_shift: tuple[float, ...]
  weight_concentration: float = 1.0
  layout_seed: int = 0
  drift: tuple[float, ...] = 0.0
  task_steps: int = 0

  def __post_init__(self):
    if self.num_layers < 1 or self.num_experts < 1:
      raise ValueError(f"num_layers and num_experts must be positive, got {self.num_layers} and "
                       f"{self.num_experts}")
    if not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
    for name in _PER_LAYER:
      value = np.asarray(getattr(self, name), np.float64)
      if value.ndim == 0:  # one number for every layer
        value = np.full(self.num_layers, value)
      if value.shape != (self.num_layers,):
        raise ValueError(f"{name} needs one value per layer ({self.num_layers}) or a single "
                         f"number, got shape {value.shape}: resample a profile with scaled()")
      object.__setattr__(self, name, tuple(value.tolist()))  # a tuple of floats (hashable)
    checks = {"skew": (0.0, np.inf, True), "reuse": (0.0, 1.0, True),
              "working_set": (0.0, 1.0, True), "working_set_decay": (0.0, 1.0, False),
              "prefill_reuse": (0.0, 1.0, True), "prefill_shift": (0.0, 1.0, True),
              "drift": (0.0, np.inf, True)}
    for name, (low, high, closed) in checks.items():
      values = np.asarray(getattr(self, name))
      ok = (values >= low) & ((values <= high) if closed else (values < high))
      if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        bracket = "]" if closed else ")"
        raise ValueError(f"{name}[{bad}] = {values[bad]} is outside [{low}, {high}{bracket}")
    if isinstance(self.task_steps, bool) or int(self.task_steps) != self.task_steps or \
        self.task_steps < 0:
      raise ValueError(f"task_steps must be a non-negative integer, got {self.task_steps!r}")
    if not self.weight_concentration > 0:
      raise ValueError(f"weight_concentration must be positive, got {self.weight_concentration}")

  def _ranks(self) -> np.ndarray:
    """Each layer's rank of every expert, decode then prefill's other order: [2L, E]."""
    layout = np.random.default_rng(self.layout_seed)
    orders = np.stack([layout.permutation(self.num_experts) for _ in range(2 * self.num_layers)])
    ranks = np.empty_like(orders)
    np.put_along_axis(ranks, orders, np.arange(self.num_experts)[None], 1)  # rank of each expert
    return ranks

  def _zipf(self, ranks: np.ndarray) -> np.ndarray:
    """The layers' Zipf laws over ``ranks`` [L, E] (or [2L, E]): rows sum to 1."""
    skew = np.asarray(self.skew)[:, None]
    laws = (ranks + 0.5) ** -np.concatenate([skew] * (len(ranks) // self.num_layers))
    return laws / laws.sum(1, keepdims=True)

  def _phase_law(self, decode: np.ndarray, other: np.ndarray, phase: int) -> np.ndarray:
    if phase not in (PREFILL, DECODE):
      raise ValueError(f"phase must be 0 (prefill) or 1 (decode), got {phase!r}")
    if phase == DECODE:
      return decode
    shift = np.asarray(self.prefill_shift)[:, None]
    return (1 - shift) * decode + shift * other

  def popularity(self, phase: int = DECODE) -> np.ndarray:
    """Each layer's popularity law of new experts at ``phase`` steps, before any task drift:
    [L, E], rows sum to 1."""
    laws = self._zipf(self._ranks())
    return self._phase_law(laws[:self.num_layers], laws[self.num_layers:], phase)

  def task_popularity(self, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """One task's laws by phase (``popularity`` with each layer's order moved by ``drift``,
    one draw from ``rng``): {PREFILL: [L, E], DECODE: [L, E]}."""
    ranks = self._ranks()
    decode = ranks[:self.num_layers].astype(np.float64)
    noise = rng.standard_normal(decode.shape) * (np.asarray(self.drift)[:, None] *
                                                 self.num_experts)
    moved = np.argsort(np.argsort(decode + noise, axis=1, kind="stable"), axis=1,
                       kind="stable")
    laws = self._zipf(np.concatenate([moved, ranks[self.num_layers:]]))
    return {p: self._phase_law(laws[:self.num_layers], laws[self.num_layers:], p)
            for p in (PREFILL, DECODE)}


class _Router:
  """The generator's state between steps: the experts of the last step, the working set and
  the task's laws. ``generate`` samples each step from it; ``next_step_probabilities``
  replays a trace through it and estimates each step's law."""

  def __init__(self, model: RoutingModel, *, seed: int, prefill_steps: int, steps: int):
    layers, experts = model.num_layers, model.num_experts
    self.model, self.prefill_steps = model, prefill_steps
    self.tasks = np.random.default_rng([seed, 1])  # task orders: a stream of their own
    self.task_steps = model.task_steps or max(steps, 1)
    self.reuse = {PREFILL: np.asarray(model.prefill_reuse, np.float32)[:, None],
                  DECODE: np.asarray(model.reuse, np.float32)[:, None]}
    self.recall = np.asarray(model.working_set, np.float32)[:, None]
    self.decay = np.asarray(model.working_set_decay, np.float32)[:, None]
    self.rows = np.arange(layers)[:, None]
    self.recent = np.zeros((layers, experts), np.float32)  # working-set weight of each expert
    self.previous = np.zeros((layers, model.top_k), np.int64)  # the experts of the last step
    self.t = 0
    self.laws = None

  def law(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Step ``t``'s law: (the mixture new experts are drawn from [L, E], the experts of the
    last step [L, E] bool, each one's chance to be kept [L, 1], or None at the first step)."""
    model, t = self.model, self.t
    phase = PREFILL if t < self.prefill_steps else DECODE
    if t == 0 or (phase == DECODE and t > self.prefill_steps and
                  (t - self.prefill_steps) % self.task_steps == 0):  # a new task
      laws = (model.task_popularity(self.tasks) if any(model.drift) else
              {p: model.popularity(p) for p in (PREFILL, DECODE)})
      self.laws = {p: law.astype(np.float32) for p, law in laws.items()}
    was_routed = np.zeros((model.num_layers, model.num_experts), bool)
    if t:
      was_routed[self.rows, self.previous] = True
    candidates = np.where(was_routed, np.float32(0), self.recent)  # [L, E]
    mass = candidates.sum(1, keepdims=True)
    recall = np.where(mass > 0, self.recall, np.float32(0))  # nothing to recall yet: popularity
    mixture = (1 - recall) * self.laws[phase] + (recall / np.maximum(mass, 1e-30)) * candidates
    return mixture, was_routed, (self.reuse[phase] if t else None)

  def draw(self, rng: np.random.Generator, law, samples: int | None = None) -> np.ndarray:
    """Routes drawn from ``law`` (``self.law()``): [L, K], or [samples, L, K]."""
    mixture, was_routed, reuse = law
    layers, experts, top_k = self.model.num_layers, self.model.num_experts, self.model.top_k
    lead = () if samples is None else (samples,)
    if reuse is not None:
      keep = rng.random(lead + (layers, top_k), dtype=np.float32) < reuse  # [.., L, K]
    else:
      keep = np.zeros(lead + (layers, top_k), bool)
    # Exponential race: the top_k smallest noise / mixture are a draw without replacement with
    # probabilities proportional to the mixture, in draw order.
    keys = rng.standard_exponential(lead + (layers, experts), dtype=np.float32) / np.maximum(
        mixture, np.float32(1e-30))
    keys[..., was_routed] += np.float32(1e34)  # dropped experts only if nothing else is left
    previous = np.broadcast_to(self.previous, keep.shape)
    kept = np.nonzero(keep)
    keys[kept[:-1] + (previous[kept],)] = np.inf  # kept experts are routed already
    best = np.argpartition(keys, top_k - 1, axis=-1)[..., :top_k]  # [.., L, K] unordered
    best = np.take_along_axis(best, np.argsort(np.take_along_axis(keys, best, -1), -1), -1)
    fresh_index = np.cumsum(~keep, axis=-1) - 1  # the n-th new route takes the n-th draw
    return np.where(keep, previous, np.take_along_axis(best, np.maximum(fresh_index, 0), -1))

  def advance(self, current: np.ndarray) -> None:
    """Moves to the next step after routing ``current`` [L, K]."""
    self.recent *= self.decay
    self.recent[self.rows, current] += np.float32(1)
    self.previous = np.asarray(current, np.int64)
    self.t += 1


def generate(model: RoutingModel, steps: int, *, seed: int, prefill_steps: int = 0) -> Trace:
  """Samples a trace of ``prefill_steps`` prefill steps followed by ``steps`` decode steps.

  Returns a ``Trace`` with ids [prefill_steps + steps, L, K] (every route present, distinct
  experts per step-layer), weights of the same shape (positive, summing to 1 over K, in
  descending order), phase 0 for the prefill steps and 1 after, and metadata naming the
  generator and its parameters. Deterministic for a given ``seed`` (and model).
  """
  if steps < 0 or prefill_steps < 0:
    raise ValueError(f"steps and prefill_steps must be non-negative, got {steps} and "
                     f"{prefill_steps}")
  layers, top_k = model.num_layers, model.top_k
  total = prefill_steps + steps
  rng = np.random.default_rng(seed)
  router = _Router(model, seed=seed, prefill_steps=prefill_steps, steps=steps)
  ids = np.zeros((total, layers, top_k), np.int32)
  for t in range(total):
    ids[t] = router.draw(rng, router.law())
    router.advance(ids[t])
  weights = rng.gamma(model.weight_concentration, size=(total, layers, top_k))
  weights = -np.sort(-weights, axis=-1)
  weights /= weights.sum(-1, keepdims=True)
  weights = np.maximum(weights, np.finfo(np.float32).tiny)  # positive after float32 rounding
  phases = (np.arange(total) >= prefill_steps).astype(np.uint8)
  metadata = {"source": "ftjax.research.synthetic", "seed": int(seed),
              "prefill_steps": int(prefill_steps), "routing_model": dataclasses.asdict(model)}
  return Trace.from_arrays(ids, weights, model.num_experts, phase=phases, metadata=metadata)


def with_predictions(trace: Trace, recall: float | Sequence[float], *, seed: int = 0) -> Trace:
  """``trace`` with ``predicted`` ids from a modelled predictor of the given ``recall`` (one
  value, or one per layer): each true expert of a layer-step is named with probability
  ``recall``, and the others are replaced by experts drawn without replacement from the
  layer's routing frequency over the trace (a wrong prediction names a popular expert, as a
  router applied to an earlier hidden state does), in random order. Stands in for router-ahead
  on traces that hold ids only; ``benchmarks/router_ahead.py`` measures the recall of the
  real predictor (0.71 a layer ahead, 0.87-0.90 one sublayer ahead on the embedded models).
  Deterministic for a given ``seed``."""
  steps, layers, top_k = trace.ids.shape
  experts = trace.num_experts
  recall = np.broadcast_to(np.asarray(recall, np.float64), (layers,))
  if np.any((recall < 0) | (recall > 1)):
    raise ValueError(f"recall must be in [0, 1], got {recall.tolist()}")
  rng = np.random.default_rng(seed)
  freq = np.ones((layers, experts))  # add-one: every expert can be named
  for layer in range(layers):
    ids = trace.ids[:, layer].reshape(-1)
    np.add.at(freq[layer], ids[ids >= 0], 1.0)
  freq /= freq.sum(1, keepdims=True)
  predicted = np.empty_like(trace.ids)
  for s in range(steps):  # per step: [L, E] Gumbel keys, the true experts masked out
    true = trace.ids[s]
    keys = np.log(freq) + rng.gumbel(size=(layers, experts))
    np.put_along_axis(keys, np.maximum(true, 0), -np.inf, axis=1)
    others = np.argsort(-keys, axis=1)[:, :top_k]
    keep = (rng.random((layers, top_k)) < recall[:, None]) & (true >= 0)
    dropped = np.cumsum(~keep, axis=1) - 1  # the i-th dropped route takes the i-th other
    row = np.where(keep, true, np.take_along_axis(others, np.maximum(dropped, 0), axis=1))
    order = np.argsort(rng.random((layers, top_k)), axis=1)
    predicted[s] = np.take_along_axis(row, order, axis=1)
  metadata = dict(trace.metadata, predictor={"kind": "modelled", "recall": recall.tolist(),
                                             "seed": int(seed)})
  return Trace.from_arrays(trace.ids, trace.weights, experts, phase=trace.phase,
                           metadata=metadata, predicted=predicted)


def model_of(trace: Trace) -> RoutingModel:
  """The ``RoutingModel`` a trace of ``generate`` was sampled from (its metadata)."""
  meta = trace.metadata
  if meta.get("source") != "ftjax.research.synthetic" or "routing_model" not in meta:
    raise ValueError("the trace was not sampled by ftjax.research.synthetic.generate (its "
                     "metadata names no routing model): the law of its next steps is unknown")
  fields = dict(meta["routing_model"])
  return RoutingModel(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def next_step_probabilities(trace: Trace, *, samples: int = 256, seed: int = 0,
                            progress: bool = False) -> np.ndarray:
  """Each expert's chance to be routed at each step of a synthetic trace, given the steps
  before it: [S, L, E] float32 (rows sum to ``top_k``).

  The trace is replayed through its generator (``model_of``): at each step its law (the kept
  experts of the last step, the new ones drawn from the popularity and working-set mixture
  of the step's task) is sampled ``samples`` times from a stream of its own (``seed``), and
  an expert's probability is the share of those draws that route it: a Monte Carlo estimate
  with a standard error of at most ``0.5 / sqrt(samples)``. The layers of the generator are
  independent, so a step's earlier layers say nothing more about a layer.
  (``ftjax.research.bound`` turns these into an upper bound on every online policy.)
  """
  if samples < 1:
    raise ValueError(f"samples must be positive, got {samples}")
  model = model_of(trace)
  meta = trace.metadata
  if "held_out_steps" in meta:  # sweep.split_warmup's replayed part
    raise ValueError(f"the trace is what follows the first {meta['held_out_steps']} steps of a "
                     "generated trace, and the law of its steps depends on those: pass the "
                     "whole trace")
  prefill = int(meta.get("prefill_steps", 0))
  router = _Router(model, seed=int(meta["seed"]), prefill_steps=prefill,
                   steps=trace.num_steps - prefill)
  mc = np.random.default_rng([seed, 2])
  out = np.zeros((trace.num_steps, model.num_layers, model.num_experts), np.float32)
  inclusion = np.zeros((samples, model.num_layers, model.num_experts), np.float32)
  bar = Progress(trace.num_steps, desc="next-step law", enabled=progress)
  for t in range(trace.num_steps):
    draws = router.draw(mc, router.law(), samples)  # [samples, L, K]
    inclusion[:] = 0
    np.put_along_axis(inclusion, draws, np.float32(1), -1)
    out[t] = inclusion.mean(0)
    router.advance(trace.ids[t])
    bar.update()
  bar.close()
  return out


def fit_skew(model: RoutingModel, shares: Sequence[float], *, top_n: int | None = None,
             steps: int = 3000, iterations: int = 8, seed: int = 0) -> RoutingModel:
  """Re-fits ``model.skew`` so that each layer's ``top_n`` most-selected experts take
  ``shares[l]`` of its decode selections (``top_n`` defaults to an eighth of the experts).

  The realised share depends on the skew and on the reuse and working-set dynamics, so it is
  matched by simulation: ``iterations`` rounds of generating ``steps`` decode steps (seed
  ``seed + round``) and moving each layer's exponent in proportion to its error. The result
  is deterministic; the error left is the sampling noise of ``steps`` (about ±0.01 at 3000).
  The shares are per task: the fit generates without ``drift``, which only permutes each
  task's law and so leaves a task's share as it is.
  """
  shares = np.asarray(shares, np.float64).reshape(-1)
  if shares.shape != (model.num_layers,):
    raise ValueError(f"shares needs one value per layer ({model.num_layers}), got {shares.shape}")
  top_n = max(1, model.num_experts // 8) if top_n is None else top_n
  uniform = min(1.0, top_n / model.num_experts)
  if not ((shares >= uniform) & (shares <= 1)).all():
    raise ValueError(f"shares must be in [{uniform:.3f} (uniform popularity), 1], got "
                     f"{shares.min():.3f}..{shares.max():.3f}")
  skew = np.asarray(model.skew)
  for i in range(iterations):
    trial = dataclasses.replace(model, skew=tuple(skew), drift=0.0)  # shares are per task
    achieved = routing_stats.top_share(generate(trial, steps, seed=seed + i), top_n)
    gain = 2.5 if i < iterations // 2 else 1.5  # d(skew)/d(share) is about 3 near the targets
    skew = np.maximum(skew + gain * (shares - achieved), 0.0)
  error = np.abs(shares - achieved)
  if error.max() > 0.05:
    layer = int(error.argmax())
    warnings.warn(
        f"fit_skew: layer {layer} reaches a top-{top_n} share of {achieved[layer]:.3f}, not "
        f"{shares[layer]:.3f}. An expert dropped after a step is not drawn at the next, so "
        f"it is routed at most 1 / (2 - reuse) of the steps and the top {top_n} experts take "
        f"at most {top_n} / ({model.top_k} * (2 - reuse)) of the routes: lower the target or "
        f"the reuse, or raise iterations if the error was still falling", stacklevel=2)
  return dataclasses.replace(model, skew=tuple(np.round(skew, 4).tolist()))


def _by_depth(values: Sequence[float], num_layers: int) -> tuple[float, ...]:
  """Resamples a per-layer profile to ``num_layers`` layers by relative depth (linear)."""
  values = np.asarray(values, np.float64)
  source = np.linspace(0.0, 1.0, len(values)) if len(values) > 1 else np.zeros(1)
  return tuple(np.interp(np.linspace(0.0, 1.0, num_layers), source, values).tolist())


def qwen3_overlap_profile(num_layers: int = 48) -> np.ndarray:
  """The per-layer decode overlap profile of Qwen3-30B-A3B assumed here: [num_layers].

  Published anchors (48 layers): 8% at layer 0, about 60% at layer 7, about 21% at layer
  47, 42.7% on average. Between them: a square-root rise ``0.08 + 0.52 * sqrt(l / 7)`` to
  layer 7, then a concave fall ``0.21 + 0.39 * (1 - x ** 1.365)`` with ``x = (l - 7) / 40``,
  whose exponent makes the mean 42.7%. Other depths are resampled by relative depth.
  """
  layer = np.arange(48)
  rise = 0.08 + 0.52 * np.sqrt(np.minimum(layer, 7) / 7)
  fall = 0.21 + 0.39 * (1 - np.clip((layer - 7) / 40, 0, 1) ** 1.365)
  profile = np.where(layer <= 7, rise, fall)
  return profile if num_layers == 48 else np.asarray(_by_depth(profile, num_layers))


def qwen3_top_share_profile(num_layers: int = 48) -> np.ndarray:
  """The per-layer share of selections of the top eighth of experts (16 of 128) assumed for
  Qwen3-30B-A3B: [num_layers].

  Published: 41-66% depending on the layer, per-layer values not given. Assumed here:
  popularity is as concentrated as routing is persistent, i.e. the share maps the overlap
  profile linearly onto [0.415, 0.655] (layer 0 the flattest, layer 7 the most skewed,
  layer 47 at 0.475), inside the published range with a margin for sampling noise.
  """
  overlap = qwen3_overlap_profile(num_layers)
  return 0.415 + 0.24 * (overlap - 0.08) / 0.52


# fit_skew(..., qwen3_top_share_profile(), steps=6000) from skew 1.0 with the other parameters
# of qwen3_30b_a3b(); see docs/synthetic.md.
_QWEN3_SKEW = (
    0.841, 1.092, 1.205, 1.311, 1.390, 1.468, 1.538, 1.616, 1.596, 1.587, 1.605, 1.579,
    1.555, 1.552, 1.529, 1.532, 1.523, 1.513, 1.468, 1.468, 1.453, 1.438, 1.432, 1.407,
    1.394, 1.383, 1.364, 1.338, 1.326, 1.315, 1.288, 1.287, 1.256, 1.243, 1.220, 1.210,
    1.189, 1.173, 1.161, 1.141, 1.133, 1.096, 1.097, 1.069, 1.063, 1.040, 1.027, 1.011,
)


QWEN3_DRIFT, QWEN3_TASK_STEPS = 0.4, 250  # calibrated to the paper's Fig. 4b, see below


def qwen3_30b_a3b(**overrides) -> RoutingModel:
  """Qwen3-30B-A3B routing (48 layers, 128 experts, top-8), calibrated to published statistics.

  Decode targets: consecutive tokens share 42.7% of their experts on average (per layer
  ``qwen3_overlap_profile``); a per-layer LRU of 8 / 16 / 32 / 64 experts hits 42.4 / 64.7 /
  81.0 / 91.8% (mean over layers); the top 16 experts take 41-66% of a layer's selections
  (per layer ``qwen3_top_share_profile``). ``reuse`` is the overlap profile, ``skew`` is
  fitted to the share profile, and one ``working_set`` (0.1) and ``working_set_decay`` (0.9:
  recalled experts were routed some 10 steps ago) for all layers were chosen among trial
  points to match the LRU curve. The prefill parameters are not calibrated (no published
  prefill statistics): prefill reuses like decode and takes 30% of its popularity from a
  different expert order.

  Tasks: 250 decode steps each, every task's expert order drifting by ``drift`` = 0.4 (Gaussian
  noise of 0.4·E ranks). There is no published figure for the drift itself; it is calibrated
  to the paper's Fig. 4b at 37% cache on the RTX 5090 server: a ``static_hot`` set counted on
  other tasks (another seed) misses 41.7% of routed experts (paper ~41%), ``static_layers``
  64.6% (~62%), ``freetoken`` 11.9% (paper ~16%: the per-layer LRU statistics above leave
  the LRU policies no worse than that); docs/synthetic.md has the table.

  ``overrides`` replace fields (``layout_seed=1``, ``prefill_shift=0.5``, ...).
  """
  overlap = tuple(np.round(qwen3_overlap_profile(), 4).tolist())
  model = RoutingModel(num_layers=48, num_experts=128, top_k=8, skew=_QWEN3_SKEW, reuse=overlap,
                       working_set=0.1, working_set_decay=0.9, prefill_reuse=overlap,
                       prefill_shift=0.3, drift=QWEN3_DRIFT, task_steps=QWEN3_TASK_STEPS)
  return dataclasses.replace(model, **overrides)


def mixtral_top_share_profile(num_layers: int = 32) -> np.ndarray:
  """The per-layer share of selections of a layer's two most popular experts (of 8) assumed
  for Mixtral-8x7B: [num_layers]. Measured on real decode traces (issue 17): 27-36%, median
  32% (uniform is 25%), per-layer values not given. Assumed here: linear in depth from 28% to
  36% (median 32%), inside the range with a margin for sampling noise."""
  return np.linspace(0.28, 0.36, num_layers)


# fit_skew(mixtral_8x7b(skew=0.3), mixtral_top_share_profile(), top_n=2, steps=6000) with the
# other parameters of mixtral_8x7b(); see docs/synthetic.md.
_MIXTRAL_SKEW = (
    0.151, 0.1536, 0.1656, 0.1902, 0.1871, 0.1959, 0.2183, 0.2338, 0.2235, 0.2578, 0.2706,
    0.283, 0.2896, 0.3005, 0.3151, 0.3273, 0.3412, 0.3542, 0.3558, 0.3787, 0.3911, 0.4049,
    0.3993, 0.4284, 0.4558, 0.4411, 0.4727, 0.483, 0.4999, 0.4983, 0.523, 0.5345,
)


def mixtral_8x7b(**overrides) -> RoutingModel:
  """Mixtral-8x7B routing (32 layers, 8 experts, top-2), calibrated to real decode traces.

  Targets (public Mixtral-8x7B decode traces measured outside this project, issue 17): a
  per-layer LRU of 2 / 3 / 4 / 5 / 6 of the 8 experts hits 0.32 / 0.46 / 0.59 / 0.70 / 0.80;
  consecutive tokens share 37.5% of their experts; a layer's two most popular experts take
  27-36% of its selections (median 32%). ``reuse`` = 0.35 for every layer, no working set
  (``working_set`` 0: with 8 experts the popularity law alone gives the LRU curve), ``skew``
  fitted to ``mixtral_top_share_profile``. Achieved (3000 decode steps, seed 1): LRU 0.351 /
  0.467 / 0.582 / 0.693 / 0.799, overlap 35.1%, top-2 share 28.5-35.9% (median 31.7%). The
  two first targets conflict: a per-layer LRU of 2 experts holds exactly the previous
  token's two, so its hit rate equals the consecutive overlap; 0.35 sits between 0.32 and
  0.375. No drift between tasks (no figure for it; ``drift=`` adds it), prefill as in
  ``qwen3_30b_a3b``.
  """
  model = RoutingModel(num_layers=32, num_experts=8, top_k=2, skew=_MIXTRAL_SKEW, reuse=0.35,
                       working_set=0.0, working_set_decay=0.5, prefill_reuse=0.35,
                       prefill_shift=0.3)
  return dataclasses.replace(model, **overrides)


# fit_skew(fine_grained(skew=1.0), [FINE_TOP12_SHARE] * 61, top_n=12, steps=1500, iterations=6)
# with the other parameters of fine_grained(): the same skew at every depth, rounded.
_FINE_SKEW = 1.27
FINE_TOP12_SHARE = 0.46  # the top 12 of 256 experts (700 slots / 61 layers) take 46%


def fine_grained(**overrides) -> RoutingModel:
  """Fine-grained routing (61 layers, 256 experts, top-8), calibrated to a field report on
  DeepSeek-V4-Flash decode (FreeToken issue 174, RTX 5090, a cache of 700 slots, 4.5% of the
  experts): 240-248 of a layer's 256 experts are live in decode, a global LRU of the 700 slots
  hits 8-18% of the routed experts, and a stationary frequency oracle (the 700 most selected)
  would hit 46%.

  ``skew`` (one exponent for every layer) is fitted so that a layer's 12 most selected experts
  (700 / 61) take 46% of its selections; ``reuse`` = 0.1 (few experts repeat from one token to
  the next; no published figure) and no working set. Achieved (500 decode steps, seed 1): 237-252
  experts live per layer (median 245), top-12 shares 45-46%, ``lru_fill`` at 700 slots hits
  10.0%, ``static_hot`` with the trace's own counts 44.8%. No task drift, prefill as in
  ``qwen3_30b_a3b``. The shape is ``configs/models/fine-grained-61x256.json``.
  """
  model = RoutingModel(num_layers=61, num_experts=256, top_k=8, skew=_FINE_SKEW, reuse=0.1,
                       working_set=0.0, working_set_decay=0.5, prefill_reuse=0.1,
                       prefill_shift=0.3)
  return dataclasses.replace(model, **overrides)


def scaled(model: RoutingModel, *, num_layers: int | None = None, num_experts: int | None = None,
           top_k: int | None = None, refit: bool = True, steps: int = 2000,
           seed: int = 0) -> RoutingModel:
  """The routing of ``model`` carried over to another shape, keeping its relative statistics.

  * Layers: every per-layer profile is resampled by relative depth (layer ``l`` of ``L``
    sits at ``l / (L - 1)``), linearly; a change of depth alone changes nothing else.
  * ``top_k``: ``reuse`` is a per-expert probability, so consecutive steps keep sharing the
    same fraction of their ``top_k``; the working set is in steps and carries over as is.
  * Experts (or ``top_k``): the same Zipf exponent puts a different share on the top eighth
    of the experts once E or K change, so with ``refit`` (default) ``skew`` is re-fitted
    (``fit_skew``, ``steps`` decode steps per round) until each layer's top E/8 experts take
    the share they take in ``model`` (measured on ``steps`` steps of it): popularity is
    preserved in fractions of the experts. This takes a few seconds.

  Not preserved: LRU hit rates at a fixed fraction of the experts, which depend on how many
  steps of routing that fraction holds (E/K): at fixed K they rise with E.
  """
  num_layers = model.num_layers if num_layers is None else num_layers
  num_experts = model.num_experts if num_experts is None else num_experts
  top_k = model.top_k if top_k is None else top_k
  resampled = {name: _by_depth(getattr(model, name), num_layers) for name in _PER_LAYER}
  target = dataclasses.replace(model, num_layers=num_layers, num_experts=num_experts,
                               top_k=top_k, **resampled)
  if not refit or (num_experts, top_k) == (model.num_experts, model.top_k):
    return target
  shares = routing_stats.top_share(generate(dataclasses.replace(model, drift=0.0), steps,
                                            seed=seed), max(1, model.num_experts // 8))
  uniform = min(1.0, max(1, num_experts // 8) / num_experts)  # the least share fit_skew takes
  shares = np.maximum(_by_depth(shares, num_layers), uniform)
  return fit_skew(target, shares, steps=steps, iterations=6, seed=seed)
