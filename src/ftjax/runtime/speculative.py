"""Speculative decoding with the model's multi-token-prediction (MTP) head (issue 30): the head
drafts ``k`` tokens, one batched forward of the model verifies them, and the longest prefix the
model agrees with is kept, plus the model's own next token. Greedy or sampled (rejection
sampling, below), one sequence; everything between the prefill and the end runs in a compiled
``lax.while_loop`` (no host round trip per token: the host reads a chunk of verify steps at a
time; with the adaptive draft length, also each time the length changes: one program per
length, ``decode_program``).

One verify step, with the model at length n (it has read positions < n), its next token t
(not yet read) and the MTP head's pending inputs:

1. The head catches up: over the pending positions (the model's hidden states there, after its
   final norm, and the token after each) it writes its KV rows and, at the last one, drafts
   d_1 (``valid`` of the ``k + 1`` pending entries are real; the rest pad and are
   overwritten later). Then d_2 .. d_k, each from the head's own previous hidden state
   (``MTPHead``).
2. The model reads [t, d_1, .., d_k] at positions n .. n + k in one forward that keeps its
   recurrent (Gated DeltaNet) states after each token (``snapshot_at``), and greedy targets
   y_0 .. y_k come from its logits.
3. a = the number of leading drafts equal to their targets (d_{i+1} == y_i). Tokens y_0 .. y_a
   are emitted (a + 1 of them: the accepted drafts and the model's own next token). The
   model's state is rolled back to length n + a + 1: KV rows past it are masked by the
   length (and overwritten later), each recurrent layer takes its state after a + 1 tokens.
   The pending inputs become positions n .. n + a with the verify's hidden states and
   tokens y_0 .. y_a.

Each emitted token is the model's greedy choice after the same context as plain decoding, so
the output equals plain greedy decoding (up to float32 ties between a batched and a one-token
forward; tests check token for token). Stop tokens and ``max_new_tokens`` cut the emitted run.

Sampling (temperature > 0, with top-p / top-k) uses speculative rejection sampling (Leviathan
et al. 2023; Chen et al. 2023): the head draws d_j from its own distribution q_j (its logits
under the request's temperature and filters), the model gives p_j for the same positions
(``sampling.distribution``: the distribution plain sampling draws from), and draft j is
accepted with probability min(1, p_j(d_j) / q_j(d_j)), in order, until the first rejection.
At the first rejected position the token is drawn from max(0, p_j - q_j), normalised; with
every draft accepted, from p_k. Each emitted token then follows exactly the distribution plain
sampling gives it (the same distribution, not the same draws: the random stream differs from
plain decoding's). A forced draft has q_j one-hot at the forced token.

The expert cache serves the head's routed experts like any layer's (bank layers after the
decoder's). Step records (cache counts) of these programs are not kept in the engine's
statistics yet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from ftjax.model import KVCache, abstract_params
from ftjax.model.transformer import param_name
from ftjax.utils.dense_quant import QuantizedMatrix
from ftjax.runtime.programs import ProgramKind, Runner
from ftjax.runtime.sampling import Sampling, distribution, greedy_tokens, sample
from ftjax.runtime.state import EngineState

MAX_DRAFT_TOKENS = 4


@struct.dataclass
class Draft:
  """The speculative loop's carry besides the engine state (on the device)."""
  caches: tuple[KVCache, ...]  # the MTP layers' KV caches
  length: jax.Array  # int32 []: the head's KV rows filled (the first pending position)
  hidden: jax.Array  # float32 [1, k + 1, D]: pending hidden states
  tokens: jax.Array  # int32 [1, k + 1]: the token after each pending hidden state
  valid: jax.Array  # int32 []: pending entries that are real (1 .. k + 1)
  count: jax.Array  # int32 []: tokens emitted so far
  done: jax.Array  # bool []: a stop token was emitted or max_new reached
  steps: jax.Array  # int32 []: verify steps run
  accepted: jax.Array  # int32 [k]: verify steps whose draft i was accepted
  # int32 [capacity]: where >= 0, the draft proposing emitted token i is forced to forced[i]
  # (the head's draft is still computed): research, to run at a chosen acceptance
  forced: jax.Array
  # The adaptive draft length's running acceptance: per draft position j, the decayed count
  # of steps that checked draft j (drafts before it kept) and of those that kept it.
  tried: jax.Array  # float32 [k]
  kept: jax.Array  # float32 [k]
  chosen: jax.Array  # int32 [k + 1]: verify steps run with each draft length 0 .. k
  idle: jax.Array  # int32 []: steps since one last drafted
  # int32 []: the idle steps after which the rule drafts one token anyway (a probe): doubled
  # by each probe that keeps nothing (up to MAX_PROBE_EVERY), PROBE_EVERY after one that keeps
  probe: jax.Array


@dataclasses.dataclass(frozen=True)
class SpeculativeResult:
  """What ``generate_speculative`` returns: the tokens, how the drafts fared, and the
  timings of ``ftjax.runtime.engine.GenerateResult`` (compiles left out)."""
  tokens: list[int]  # new tokens only
  draft_tokens: int
  steps: int  # verify steps
  accepted: list[int]  # per draft position i: steps whose draft i was accepted
  prompt_tokens: int = 0
  lengths: list[int] = dataclasses.field(default_factory=list)  # steps with 0 .. k drafts
  prefill_s: float = 0.0  # the prompt and the head's reading of it, to the first token
  decode_s: float = 0.0  # the verify steps
  compile_s: float = 0.0
  # The cost per draft length 0 .. k the adaptive rule ranked with at the end: seconds a verify
  # step (measured by the engine, or modelled bytes scaled to seconds, ``calibrated_costs``).
  costs: list[float] = dataclasses.field(default_factory=list)

  @property
  def prefill_tok_s(self) -> float:
    return self.prompt_tokens / self.prefill_s if self.prefill_s else float("nan")

  @property
  def decode_tok_s(self) -> float:
    return (len(self.tokens) - 1) / self.decode_s if self.decode_s else float("nan")

  @property
  def acceptance(self) -> list[float]:
    """Per draft position: the fraction of verify steps that accepted it."""
    return [a / self.steps if self.steps else 0.0 for a in self.accepted]

  @property
  def tokens_per_step(self) -> float:
    """Tokens emitted per verify step (the first token comes from the prefill)."""
    return (len(self.tokens) - 1) / self.steps if self.steps else 0.0


def _stopped(token, stop_ids):
  return jnp.any(token == stop_ids)


def accept_sampled(key: jax.Array, drafts: jax.Array, q: jax.Array, p: jax.Array):
  """Speculative rejection sampling of one verify step: ``drafts`` int32 [k], drawn from ``q``
  float32 [k, V] (row j the distribution draft j was drawn from), and the model's
  distributions ``p`` float32 [k + 1, V] at the same positions and one past. Returns (a, the
  emitted tokens int32 [k + 1]): the first a drafts accepted, token a drawn from the residual
  max(0, p_a - q_a) normalised (from p_k when every draft is accepted); entries past a are
  padding. Each emitted token follows p given the tokens before it."""
  k, v = q.shape
  at = jnp.arange(k)
  u_key, r_key = jax.random.split(key)
  u = jax.random.uniform(u_key, (k,), jnp.float32)
  # accept with probability min(1, p/q): u < p / q, written without the division
  ok = u * q[at, drafts] < p[at, drafts]
  a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
  residual = jnp.maximum(p[a] - jnp.concatenate([q, jnp.zeros((1, v), q.dtype)])[a], 0.0)
  # p_a == q_a exactly leaves no residual, and no rejection can then happen: draw from p_a
  residual = jnp.where(jnp.sum(residual) > 0, residual, p[a])
  last = jax.random.categorical(r_key, jnp.log(residual)).astype(jnp.int32)
  span = jnp.arange(k + 1)
  return a, jnp.where(span < a, jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)]), last)


def prefill_program(runner: Runner, params, bank, state: EngineState, caches, tokens, max_new,
                    stop_ids, forced, sampling: Sampling, *, k: int):
  """The prompt ``tokens [1, n]`` into an empty state; the head reads positions 0 .. n - 2
  (each with the token after it). Returns (state, draft, first token): the model's token
  after the prompt (greedy or sampled as plain decoding picks it), and the head's pending
  input at position n - 1."""
  n = tokens.shape[1]
  positions = jnp.arange(n, dtype=jnp.int32)[None]
  state, hidden, logits, _, _ = runner.forward_hidden(params, bank, state, tokens, positions,
                                                      fresh=True)
  first = sample(logits[0, -1], sampling, jnp.zeros((), jnp.int32), kernels=runner.kernels)
  if n > 1:
    state, caches, _, _, _ = runner.mtp_step(params, bank, state, caches, jnp.zeros((), jnp.int32),
                                             hidden[:, :-1], tokens[:, 1:], positions[:, :-1],
                                             fresh=True)
  d = hidden.shape[-1]
  draft = Draft(
      caches=caches, length=jnp.asarray(n - 1, jnp.int32),
      hidden=jnp.zeros((1, k + 1, d), jnp.float32).at[:, 0].set(hidden[:, -1]),
      tokens=jnp.zeros((1, k + 1), jnp.int32).at[:, 0].set(first),
      valid=jnp.ones((), jnp.int32), count=jnp.ones((), jnp.int32),
      done=_stopped(first, stop_ids) | (max_new <= 1), steps=jnp.zeros((), jnp.int32),
      accepted=jnp.zeros((k,), jnp.int32), forced=forced, tried=jnp.zeros((k,), jnp.float32),
      kept=jnp.zeros((k,), jnp.float32), chosen=jnp.zeros((k + 1,), jnp.int32),
      idle=jnp.zeros((), jnp.int32), probe=jnp.asarray(PROBE_EVERY, jnp.int32))
  return state, draft, first


# The adaptive rule's acceptance estimate forgets at this rate per verify step (a window of
# about 20 steps), and a step drafts at least one token after PROBE_EVERY without drafting, so
# the estimate follows the text; each probe that keeps nothing doubles that wait, up to
# MAX_PROBE_EVERY (at acceptance 0 a probe costs a verify step of 2 tokens: at full depth
# ~2 plain steps, measured in issue 51, so 6% of the time at a fixed 16 steps).
DECAY = 0.95
PROBE_EVERY = 16
MAX_PROBE_EVERY = 256


@functools.lru_cache(maxsize=8)
def _element_counts(config) -> dict[str, int]:
  """Parameter name -> element count (``abstract_params`` traces the model's construction,
  ~0.25 s on the embedded hybrid model: once per config, not once per request)."""
  return {n: int(np.prod(a.shape)) for n, a in abstract_params(config).items()}


def step_costs(model, k: int) -> np.ndarray:
  """float32 [k + 1]: the bytes a verify step with 0 .. k drafts reads, the cost model of the
  adaptive draft length (``model``: an ``ftjax.runtime.model.Model``). Decode reads its
  weights at one bandwidth on the CPU (dense weights and host-run experts alike), so bytes
  rank the lengths as seconds do. A step with m drafts reads:

  - the model's verify forward of m + 1 tokens: every dense weight but the embedding table
    once, and in each decoder layer the distinct experts of m + 1 routes of top-k, expected
    E (1 - (1 - top_k / E)^(m + 1)) under uniform routing;
  - the head's catch-up over the pending positions (at most m + 1; its dense weights and
    their distinct experts) and, where m > 0, the lm_head for the first draft's logits;
  - m - 1 further draft steps, each the head's dense weights, top-k experts and the lm_head.
  """
  config = model.config
  itemsize = model.dtype.itemsize
  sizes = {n: count * itemsize for n, count in _element_counts(config).items()}
  # Quantised dense weights (--dense_dtype) read their stored bytes, data and scales.
  sizes.update({param_name(p): v.get_value().nbytes for p, v in nnx.to_flat_state(model.params)
                if isinstance(v.get_value(), QuantizedMatrix)})
  head = sizes.get("w_lm_vd", sizes["embed_vd"])  # tied embeddings: the table is the head
  mtp = sum(b for n, b in sizes.items() if n.startswith("mtp."))
  decoder = sum(b for n, b in sizes.items()
                if not n.startswith(("mtp.", "embed_vd", "w_lm_vd"))) + head
  experts, top = config.num_experts, config.top_k

  def distinct(tokens: int) -> float:
    return experts * (1.0 - (1.0 - top / experts) ** tokens)

  costs = []
  for m in range(k + 1):
    verify = decoder + config.num_decoder_moe_layers * distinct(m + 1) * model.expert_bytes
    catch_up = config.mtp_layers * (mtp + distinct(m + 1) * model.expert_bytes) + (
        head if m else 0)
    drafts = max(m - 1, 0) * (config.mtp_layers * (mtp + top * model.expert_bytes) + head)
    costs.append(verify + catch_up + drafts)
  return np.asarray(costs, np.float32)


def expected_tokens(acceptance: jax.Array) -> jax.Array:
  """Tokens a verify step emits on average with 0 .. k drafts, from each draft position's
  acceptance given the drafts before it kept (float32 [k]): 1 + sum_i prod_{j <= i} a_j."""
  return 1.0 + jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(jnp.cumprod(
      acceptance))])


def acceptance_estimate(tried: jax.Array, kept: jax.Array) -> jax.Array:
  """Per draft position, the acceptance given the drafts before it kept (float32 [k]), from
  the decayed counts: (kept_j + 2 m_j) / (tried_j + 2), a prior of weight 2 whose mean m_j is
  the estimate of the position before (0.5 for the first). A position no step has tried yet
  is expected to do as the one before it, so the rule tries it when that would pay."""
  out, prior = [], jnp.float32(0.5)
  for j in range(tried.shape[0]):
    prior = (kept[j] + 2.0 * prior) / (tried[j] + 2.0)
    out.append(prior)
  return jnp.stack(out)


def choose_draft_length(draft: Draft, cost: jax.Array) -> jax.Array:
  """The draft length 0 .. k of the next verify step: the most expected tokens per unit of
  cost (``cost`` float32 [k + 1]: a step's cost with each length, measured seconds where
  the engine has run it, else modelled, ``calibrated_costs``) at the acceptance measured so
  far (``acceptance_estimate``); at least 1 after ``draft.probe`` steps without drafting."""
  rate = expected_tokens(acceptance_estimate(draft.tried, draft.kept)) / cost
  k = jnp.argmax(rate).astype(jnp.int32)
  return jnp.where((k == 0) & (draft.idle >= draft.probe), 1, k)


def calibrated_costs(modelled: np.ndarray, measured: np.ndarray) -> np.ndarray:
  """float32 [k + 1]: a verify step's seconds with each draft length where ``measured`` has
  them (NaN where not), else the ``modelled`` cost (``step_costs``: bytes) scaled to seconds by
  the median ratio of the measured lengths; the modelled costs alone before any is measured.
  Bytes alone misrank the lengths where a verify step is compute-bound (on 2 Zen 5 cores a
  4-bit dense matrix costs 1.7x its one-token time at 2 tokens and 2.7x at 4, issue 51)."""
  modelled = np.asarray(modelled, np.float64)
  measured = np.asarray(measured, np.float64)
  known = np.isfinite(measured) & (measured > 0)
  if not known.any():
    return modelled.astype(np.float32)
  scale = float(np.median(measured[known] / modelled[known]))
  return np.where(known, measured, modelled * scale).astype(np.float32)


def after_probe(draft, before, m, a):
  """``draft.probe`` after a verify step that drafted ``m`` with ``a`` kept, from the
  carry ``before`` it: a probe (it drafted after ``probe`` idle steps) that kept nothing
  doubles the wait, one that kept resets it."""
  if not m:
    return draft
  probed = before.idle >= before.probe
  probe = jnp.where(a > 0, PROBE_EVERY, jnp.minimum(2 * before.probe, MAX_PROBE_EVERY))
  return draft.replace(probe=jnp.where(probed, probe, before.probe).astype(jnp.int32))


def decode_program(runner: Runner, params, bank, state: EngineState, draft: Draft, max_new,
                   stop_ids, sampling: Sampling, cost, *, k: int, m: int, chunk: int,
                   sampled: bool, adaptive: bool):
  """Up to ``chunk`` verify steps of ``m`` drafts each (m <= k, the module docstring),
  stopping on the device; greedy, or with rejection sampling where ``sampled``. Where
  ``adaptive``, the loop also stops before a step for which ``choose_draft_length`` (from
  ``cost``) picks another length than ``m``: the host then runs the program of that length
  (``Executor.speculate``). The length is a program, not a ``lax.switch`` over lengths inside
  the loop: XLA:CPU copies every buffer a conditional in a while loop carries (the KV caches
  and recurrent states, each step: +3.3 ms a step at 16k tokens of context on the 4-layer
  bench model, issue 51). Returns (state, draft, tokens [chunk, k + 1] int32: each step's
  emitted tokens, -1 after them, and int32 []: the length the rule picks next, m where not
  ``adaptive``)."""
  if not 0 <= m <= k:
    raise ValueError(f"a verify step drafts 0 .. k = {k} tokens, got m = {m}")
  out = jnp.full((chunk, k + 1), -1, jnp.int32)
  full_span = jnp.arange(k + 1, dtype=jnp.int32)

  def step(m, state, draft):
    """One verify step with m drafts: (state, draft, emitted tokens [k + 1])."""
    span = jnp.arange(m + 1, dtype=jnp.int32)
    before = draft
    # 1. The head catches up on the pending positions and drafts d_1, then d_2 .. d_m.
    base = draft.length
    # Padded pending entries read no experts; with no draft, no logits (the lm_head) either:
    # only the head's KV rows are wanted.
    state, caches, h, logits, _ = runner.mtp_step(
        params, bank, state, draft.caches, base, draft.hidden, draft.tokens,
        (base + full_span)[None], num_valid=draft.valid, logits=m > 0)
    last = draft.valid - 1
    keys = jax.random.split(jax.random.fold_in(
        jax.random.fold_in(jax.random.key(sampling.seed), 0x5bec), draft.count), m + 1)

    def propose(row, j):  # the head's draft j from its logits row, and its distribution
      if not sampled:
        return greedy_tokens(row[None], runner.kernels)[0], None
      q = distribution(row[None], sampling)[0]
      return jax.random.categorical(keys[j], jnp.log(q)).astype(jnp.int32), q

    proposals = [propose(logits[0, last], 0)] if m else []
    h = jax.lax.dynamic_slice_in_dim(h, last, 1, axis=1)
    n = base + draft.valid  # the model's length
    for j in range(1, m):
      at = (n + j - 1)[None, None]
      state, caches, h, logits, _ = runner.mtp_step(
          params, bank, state, caches, n + j - 1, h, proposals[-1][0][None, None], at, depth=j)
      proposals.append(propose(logits[0, 0], j))
    # [m]: d_j proposes token count + j - 1
    drafts = jnp.stack([d for d, _ in proposals]) if m else jnp.zeros((0,), jnp.int32)
    forced = jax.lax.dynamic_slice_in_dim(draft.forced, draft.count, m)
    drafts = jnp.where(forced >= 0, forced, drafts)
    # 2. The model reads [t, d_1 .. d_m], keeping its recurrent states after each token (with
    # no draft there is nothing to roll back: a plain one-token forward).
    read = jnp.concatenate([draft.tokens[0, last][None], drafts])[None]
    state, hidden, logits, _, snapshots = runner.forward_hidden(
        params, bank, state, read, (n + span)[None], fresh=False,
        snapshot_at=span + 1 if m else None)
    if sampled:  # a: the drafts accepted; target: the emitted tokens, then padding
      vocab = logits.shape[-1]
      q = (jnp.stack([q for _, q in proposals]) if m else jnp.zeros((0, vocab), jnp.float32))
      q = jnp.where((forced >= 0)[:, None], jax.nn.one_hot(drafts, vocab), q)
      a, target = accept_sampled(keys[m], drafts, q, distribution(logits[0], sampling))
    else:  # greedy targets y_0 .. y_m; a: the drafts that agree, in order
      target = greedy_tokens(logits[0], runner.kernels)  # [m + 1]
      a = jnp.sum(jnp.cumprod((drafts == target[:m]).astype(jnp.int32)))
    # 3. Keep the accepted prefix; roll the state back to it.
    if m:
      layers = tuple(layer if snap is None else jax.tree.map(lambda x: x[a], snap)
                     for layer, snap in zip(state.decode.layers, snapshots))
      state = state.replace(decode=state.decode.replace(layers=layers, length=n + a + 1))
    emit = (span <= a) & (span < max_new - draft.count)
    stop = emit & jax.vmap(_stopped, in_axes=(0, None))(target, stop_ids)
    first_stop = jnp.where(jnp.any(stop), jnp.argmax(stop), m + 1)
    emit = emit & (span <= first_stop)
    count = draft.count + jnp.sum(emit)
    pad = k - m
    checked = (full_span[:k] < m) & (full_span[:k] <= a)  # drafts before it kept
    kept = (full_span[:k] < a).astype(jnp.float32)
    draft = Draft(
        caches=caches, length=n, hidden=jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))),
        tokens=jnp.pad(target, (0, pad))[None], valid=a + 1, count=count,
        done=jnp.any(stop) | (count >= max_new), steps=draft.steps + 1,
        accepted=draft.accepted + kept.astype(jnp.int32), forced=draft.forced,
        tried=DECAY * draft.tried + checked, kept=DECAY * draft.kept + kept,
        chosen=draft.chosen.at[m].add(1), idle=jnp.where(m > 0, 0, draft.idle + 1),
        probe=draft.probe)
    draft = after_probe(draft, before, m, a)
    return state, draft, jnp.pad(jnp.where(emit, target, -1), (0, pad), constant_values=-1)

  def next_length(draft):
    return choose_draft_length(draft, cost) if adaptive else jnp.int32(m)

  def cond(carry):
    i, _, draft, _ = carry
    return (i < chunk) & ~draft.done & (next_length(draft) == m)

  def body(carry):
    i, state, draft, out = carry
    state, draft, row = step(m, state, draft)
    return i + 1, state, draft, out.at[i].set(row)

  _, state, draft, out = jax.lax.while_loop(
      cond, body, (jnp.zeros((), jnp.int32), state, draft, out))
  return state, draft, out, next_length(draft)


# The programs, run by ``ftjax.runtime.executor.Executor.speculate``.
PREFILL = ProgramKind("mtp_prefill", prefill_program, static=("k",), donate=("state", "caches"),
                      model=True)
VERIFY = ProgramKind("mtp_decode", decode_program,
                     static=("k", "m", "chunk", "sampled", "adaptive"),
                     donate=("state", "draft"), model=True)


def check_request(config, draft_tokens: int, max_new_tokens: int) -> None:
  """Refuses, with the reason, speculative decoding that cannot run on ``config``'s model."""
  if not config.mtp_layers:
    raise ValueError(
        f"speculative decoding with MTP needs the model's multi-token-prediction head, and "
        f"this {config.model_type} checkpoint has none (no mtp.* tensors): decode without "
        "--speculative, or convert a Qwen3-Next / Qwen3.5-MoE checkpoint that ships them")
  if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
    raise ValueError(f"draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {draft_tokens}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
