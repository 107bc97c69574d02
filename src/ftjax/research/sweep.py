"""Replay routing traces through the cache policies over cache sizes and hardware profiles.

Library::

  result = ftjax.research.sweep.replay(trace, "freetoken", cache_slots=64, bandwidths=(12.0, 24.0))
  result.miss_rate, result.per_layer_miss_rate, result.fills, result.host_runs
  ftjax.research.sweep.belady_misses(trace, cache_slots=64)   # the offline lower bound
  ftjax.research.bound.online_bound(trace, law, cache_slots=64)  # the online one (synthetic)
  rows = ftjax.research.sweep.sweep(traces, policies, fractions, hardware, shapes)  # the CLI's

CLI (``docs/sweep.md``)::

  python -m ftjax.sweep        # the embedded model's trace, all policies, configs/hardware
  python -m ftjax.sweep --traces=synthetic:qwen3-30b-a3b,trace.npz \\
      --cache_fractions=0.1,0.37,1 --policies=freetoken,lru_fill \\
      --hardware='configs/hardware/*.yaml' --out=DIR

Every replay runs the engine's own plan function (``ftjax.research.replay``), one token per
step. The q* policies depend on the hardware only through the number of fills ``q(m)`` for
``m`` = 0..top_k misses, so profiles with equal ``q`` tables share one replay
(``replay_many`` runs the groups of one policy and size); the others replay once per cache
size. Miss rates count every step of the trace (prefill and decode,
as Belady's bound does); per-step counts, bytes and the modeled tok/s (``ftjax.research.cost``)
count decode steps (all steps when the trace has none).
"""

from __future__ import annotations

import concurrent.futures
import csv
import dataclasses
import glob
import json
import multiprocessing
import os
import sys
from typing import Iterable, Sequence

import numpy as np
from absl import app, flags

from ftjax.assets import DEFAULT_TRACE  # --traces=default
from ftjax.cache.policy import POLICIES, fill_count, get_policy
from ftjax.model.config import ModelConfig
from ftjax.research import synthetic
from ftjax.research.bound import best_split, online_bound
from ftjax.research.cost import HardwareProfile, ModelShape, step_times
from ftjax.research.replay import (Prefetch, ReplayResult, belady_misses, expert_counts,
                                   replay, replay_many)
from ftjax.research.traces import Trace
from ftjax.utils.progress import Progress

__all__ = ["Prefetch", "ReplayResult", "belady_misses", "expert_counts", "replay", "sweep",
           "SweepRow", "load_traces", "load_traces_and_profiles", "split_warmup", "load_hardware",
           "write_csv", "plot"]

DEFAULT_FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.37, 0.5, 0.6, 0.7, 0.85, 1.0)
# synthetic:NAME -> its ftjax.research.synthetic preset
SYNTHETIC = {"qwen3-30b-a3b": "qwen3_30b_a3b", "mixtral-8x7b": "mixtral_8x7b",
             "fine-grained-61x256": "fine_grained"}


@dataclasses.dataclass
class SweepRow:
  """One (trace, policy, cache size, hardware) result. ``hardware`` is "" for Belady."""
  trace: str
  policy: str
  hardware: str
  cache_fraction: float
  cache_slots: int
  miss_rate: float
  per_layer_miss_rate: list[float]
  decode_steps: int = 0
  hits_per_step: float = float("nan")
  fills_per_step: float = float("nan")
  host_runs_per_step: float = float("nan")
  fill_gb_per_step: float = float("nan")  # host -> device copies
  device_gb_per_step: float = float("nan")  # expert weights read by device compute
  host_gb_per_step: float = float("nan")  # expert weights read by the host kernel
  modeled_ms_per_token: float = float("nan")
  modeled_tok_s: float = float("nan")
  prefetches_per_step: float = float("nan")  # with prefetch: experts prefetched (copies)
  prefetch_use_share: float = float("nan")  # of them, the share a step used
  prefetch_recall: float = float("nan")  # the predictor's: routed experts it named, share

  CSV_FIELDS = ("trace", "policy", "hardware", "cache_fraction", "cache_slots", "miss_rate",
                "decode_steps", "hits_per_step", "fills_per_step", "host_runs_per_step",
                "fill_gb_per_step", "device_gb_per_step", "host_gb_per_step",
                "modeled_ms_per_token", "modeled_tok_s", "prefetches_per_step",
                "prefetch_use_share", "prefetch_recall")


# ---------------------------------------------------------------------------- inputs


def _expand(specs: Iterable[str]) -> list[str]:
  """Comma lists and globs -> paths (a glob that matches nothing is kept, to fail clearly)."""
  out = []
  for spec in specs:
    for item in filter(None, (s.strip() for s in spec.split(","))):
      matches = sorted(glob.glob(item)) if any(c in item for c in "*?[") else []
      if any(c in item for c in "*?[") and not matches:
        raise FileNotFoundError(f"{item} matches no file (relative paths start in {os.getcwd()}; "
                                "the defaults are relative to the ftjax repository root)")
      out.extend(matches or [item])
  return out


HOLDOUT_SEED = 1000  # a synthetic trace's static_hot profile comes from seed + this
DEFAULT_HOLDOUT = 0.2  # a trace file's static_hot profile: this leading fraction of its steps


def load_traces(specs: Sequence[str], *, seed: int = 0, synthetic_steps: int = 2000,
                synthetic_prefill: int = 0) -> dict[str, Trace]:
  """``default`` (the embedded model's packaged trace), ``synthetic:NAME`` (generated,
  deterministic for ``seed``) or trace files -> traces by name."""
  return load_traces_and_profiles(specs, seed=seed, synthetic_steps=synthetic_steps,
                                  synthetic_prefill=synthetic_prefill, holdout=None)[0]


def split_warmup(trace: Trace, fraction: float) -> tuple[Trace, Trace]:
  """(the leading ``fraction`` of the steps, the rest): a warm-up part to count a routing
  profile on, held out from the part that is replayed."""
  if not 0.0 < fraction < 1.0:
    raise ValueError(f"the held-out warm-up fraction must be in (0, 1), got {fraction}")
  cut = int(round(fraction * trace.num_steps))
  if not 0 < cut < trace.num_steps:
    raise ValueError(f"a trace of {trace.num_steps} steps is too short to hold out {fraction} "
                     "of it for a routing profile")
  parts = tuple(Trace.from_arrays(trace.ids[a:b], trace.weights[a:b], trace.num_experts,
                                  phase=trace.phase[a:b], metadata=dict(trace.metadata),
                                  predicted=(None if trace.predicted is None
                                             else trace.predicted[a:b]))
                for a, b in ((0, cut), (cut, trace.num_steps)))
  parts[1].metadata["held_out_steps"] = cut
  return parts


def load_traces_and_profiles(specs: Sequence[str], *, seed: int = 0,
                             synthetic_steps: int = 2000, synthetic_prefill: int = 0,
                             holdout: float | None = DEFAULT_HOLDOUT,
                             synthetic_recall: float | None = None
                             ) -> tuple[dict[str, Trace], dict[str, np.ndarray]]:
  """Traces by name (as ``load_traces``) and, for each, a routing profile ([L, E] counts)
  counted on other routing, for ``static_hot``: a synthetic trace's from the same generator
  at seed ``seed + HOLDOUT_SEED`` (other tasks, the same length); a trace file's from its
  leading ``holdout`` fraction of steps, which is then cut from the replayed trace
  (``split_warmup``). ``holdout=None`` counts no profiles (and cuts nothing).
  ``synthetic_recall``: synthetic traces carry the predictions of a modelled predictor of
  that recall (``synthetic.with_predictions``, for the ``trace`` prefetch)."""
  traces, profiles = {}, {}
  for spec in _expand(specs):
    if spec == "default":
      if not os.path.isfile(DEFAULT_TRACE):
        raise FileNotFoundError(f"the packaged trace {DEFAULT_TRACE} is missing: reinstall "
                                "ftjax, or write it with benchmarks/sweep.py")
      traces["default-model"] = Trace.load(DEFAULT_TRACE)
      name = "default-model"
    elif spec.startswith("synthetic:"):
      name = spec.split(":", 1)[1]
      if name not in SYNTHETIC:
        raise ValueError(f"unknown synthetic trace {name!r}; choose one of "
                         f"{', '.join(SYNTHETIC)} or pass a trace file")
      model = getattr(synthetic, SYNTHETIC[name])()
      trace = synthetic.generate(model, synthetic_steps, seed=seed,
                                 prefill_steps=synthetic_prefill)
      trace.metadata.setdefault("model_shape", name)
      if synthetic_recall is not None:
        trace = synthetic.with_predictions(trace, synthetic_recall, seed=seed)
      traces[f"synthetic-{name}"] = trace
      if holdout is not None:
        profiles[f"synthetic-{name}"] = expert_counts(synthetic.generate(
            model, synthetic_steps, seed=seed + HOLDOUT_SEED, prefill_steps=synthetic_prefill))
      continue
    else:
      name = os.path.splitext(os.path.basename(spec))[0]
      traces[name] = Trace.load(spec)
    if holdout is not None:
      warmup, traces[name] = split_warmup(traces[name], holdout)
      profiles[name] = expert_counts(warmup)
  if not traces:
    raise ValueError("no traces given: pass --traces=FILE.npz or synthetic:qwen3-30b-a3b")
  return traces, profiles


def load_hardware(specs: Sequence[str]):
  profiles = [HardwareProfile.load(p) for p in _expand(specs)]
  if not profiles:
    raise ValueError("no hardware profiles given: pass --hardware='configs/hardware/*.yaml'")
  names = [p.name for p in profiles]
  if len(set(names)) != len(names):
    raise ValueError(f"hardware profile names must be distinct, got {names}")
  return profiles


def trace_shape(trace: Trace, model_shape: str | None, search_dirs: Sequence[str] = (
    "configs/models",)):
  """The ``ftjax.research.cost.ModelShape`` a trace is modeled with: ``model_shape`` (a config.json
  path) if given, else the model config captured in the trace (with the captured model's
  expert format: int8 experts are modeled with their bytes), else the synthetic preset's
  file ``configs/models/NAME.json``. Its layer and expert counts must match the trace."""
  meta = trace.metadata
  if model_shape:
    shape = ModelShape.load(model_shape)
  elif "model_config" in meta:
    shape = ModelShape.from_config(ModelConfig.from_dict(meta["model_config"]),
                                   expert_format=meta.get("expert_format"))
  elif "model_shape" in meta:
    candidates = [os.path.join(d, meta["model_shape"] + ".json") for d in search_dirs]
    found = [c for c in candidates if os.path.isfile(c)]
    if not found:
      raise FileNotFoundError(f"no shape config for {meta['model_shape']} in "
                              f"{', '.join(search_dirs)}: pass --model_shape=CONFIG.json")
    shape = ModelShape.load(found[0])
  else:
    raise ValueError("the trace carries no model config: pass --model_shape=CONFIG.json")
  return check_shape(trace, shape)


def check_shape(trace: Trace, shape):
  """``shape`` if its MoE layers and experts are the trace's, else a ValueError."""
  if (shape.num_layers, shape.num_experts) != (trace.num_layers, trace.num_experts):
    raise ValueError(f"model shape {shape.name} has {shape.num_layers} MoE layers x "
                     f"{shape.num_experts} experts but the trace has {trace.num_layers} x "
                     f"{trace.num_experts}: pass the matching --model_shape")
  return shape


# ---------------------------------------------------------------------------- the sweep


def _q_table(top_k: int, b_p: float, b_h: float) -> tuple[int, ...]:
  return tuple(int(q) for q in np.asarray(fill_count(np.arange(top_k + 1), b_p, b_h)))


def _row(name, policy, hw_name, fraction, result: ReplayResult, trace, shape, hw) -> SweepRow:
  decode = trace.phase == 1
  if not decode.any():
    decode = np.ones_like(decode, bool)
  hits, fills, host = (a[decode] for a in (result.hits, result.fills, result.host_runs))
  prefetched = None if result.prefetched is None else result.prefetched[decode]
  row = SweepRow(trace=name, policy=policy, hardware=hw_name, cache_fraction=fraction,
                 cache_slots=result.cache_slots, miss_rate=result.miss_rate,
                 per_layer_miss_rate=result.per_layer_miss_rate.tolist(),
                 decode_steps=int(decode.sum()))
  if prefetched is not None:
    row.prefetch_use_share = result.prefetch_use_share
    row.prefetches_per_step = float(prefetched.sum(1).mean()) if len(prefetched) else 0.0
    routed = result.hits + result.fills + result.host_runs
    row.prefetch_recall = float(result.predicted_named.sum() / max(routed.sum(), 1))
  if hw is not None and len(hits):
    s = shape.expert_bytes / 1e9
    row.hits_per_step = float(hits.sum(1).mean())
    row.fills_per_step = float(fills.sum(1).mean())
    row.host_runs_per_step = float(host.sum(1).mean())
    copies = row.fills_per_step + (0.0 if prefetched is None else row.prefetches_per_step)
    row.fill_gb_per_step = copies * s
    row.device_gb_per_step = (row.hits_per_step + row.fills_per_step) * s
    row.host_gb_per_step = row.host_runs_per_step * s
    t = float(np.mean(step_times(hw, shape, hits, fills, host, prefetched)))
    row.modeled_ms_per_token, row.modeled_tok_s = 1e3 * t, 1.0 / t
  return row


ORACLE = "static_hot_oracle"  # static_hot pinning the replayed trace's own hottest experts
ONLINE_BOUND = "online_bound"  # the least miss rate of an online policy (synthetic traces)
PRESCIENT = "prescient"  # the placement of the C likeliest experts, free between steps


def sweep(traces: dict[str, Trace], policies: Sequence[str], fractions: Sequence[float],
          hardware: Sequence, shapes: dict, *, belady: bool = True, progress: bool = True,
          hot_profiles: dict[str, np.ndarray] | None = None,
          workers: int = 1, bound_samples: int = 0,
          prefetch: Sequence[Prefetch] = ()) -> list[SweepRow]:
  """Every trace x policy x cache fraction x hardware profile, plus Belady's bound per trace
  and size (with a free preload, so that it bounds the preloaded static policies too).
  ``shapes`` maps trace name -> ``ftjax.research.cost.ModelShape``.

  ``static_hot`` pins the hottest experts of ``hot_profiles[trace]`` ([L, E] counts from
  other routing, ``load_traces_and_profiles``): its rows are labelled ``static_hot``. Rows
  labelled ``static_hot_oracle`` pin the replayed trace's own hottest experts, a profile no
  deployment has: an upper bound of static placement, not a policy.

  ``workers > 1`` runs the jobs in that many processes (spawned; each compiles its own plan
  programs); the rows come back in the same order as with one.

  ``bound_samples > 0`` adds, for every whole trace of ``ftjax.research.synthetic`` (others
  have no known law; a generated trace file whose first steps were held out for a profile has
  lost the steps its law depends on), the rows of ``ftjax.research.bound`` per size, after
  Belady's: ``online_bound`` (the least expected miss rate of an online policy, no hardware)
  and ``prescient`` (the C likeliest experts at every step, rearranged for free, with each
  layer-step's misses split as the cost model likes best; not a policy), from that many
  samples of each step's law.

  ``prefetch``: each policy that starts empty is also replayed with each of these
  (``ftjax.research.replay.Prefetch``), in rows labelled ``POLICY+PREDICTOR[@BUDGET]``, their
  prefetches charged in the modeled tok/s (``ftjax.research.cost.layer_step_time``). The
  ``trace`` predictor runs on traces that hold predictions only (the others are said to be
  skipped on stderr)."""
  hot_profiles = hot_profiles or {}
  for p in policies:
    get_policy(p)  # validates the name
  for f in fractions:
    if not 0.0 <= f <= 1.0:
      raise ValueError(f"cache fractions must be in [0, 1], got {f}")
  # Plan the replays: q* policies once per group of profiles with equal q tables.
  jobs = []
  for pf in prefetch:
    if pf.predictor == "trace":
      skipped = [n for n, t in traces.items() if t.predicted is None]
      if skipped:
        print(f"sweep: prefetch {pf} skips {', '.join(skipped)} (no predictions in the trace)",
              file=sys.stderr)
  for name, trace in traces.items():
    groups: dict[tuple, list] = {}
    for hw in hardware:
      groups.setdefault(_q_table(trace.top_k, hw.b_p, hw.b_h), []).append(hw)
    for fraction in fractions:
      slots = int(round(fraction * trace.num_layers * trace.num_experts))
      for policy in policies:
        if get_policy(policy).preload == "none":
          q_star = get_policy(policy).fill_rule == "q*"
          for pf in prefetch:
            if pf.predictor == "trace" and trace.predicted is None:
              continue
            if pf.budget == "link":  # sized per profile: one replay each
              for hw in hardware:
                jobs.append((name, policy, fraction, slots, [[hw]] if q_star else [hw], pf))
            else:
              jobs.append((name, policy, fraction, slots,
                           list(groups.values()) if q_star else list(hardware), pf))
        if get_policy(policy).fill_rule == "q*":  # one job replays all the groups
          jobs.append((name, policy, fraction, slots, list(groups.values())))
        elif get_policy(policy).preload == "hot":
          if name in hot_profiles:
            jobs.append((name, policy, fraction, slots, list(hardware)))
          jobs.append((name, ORACLE, fraction, slots, list(hardware)))
        else:
          jobs.append((name, policy, fraction, slots, list(hardware)))
      if belady:
        jobs.append((name, "belady", fraction, slots, []))
  rows = []
  bar = Progress(len(jobs), desc="sweep", enabled=progress)
  if workers > 1:  # the slowest jobs (most slots, several groups) first, spread over workers
    order = {_job_key(job): i for i, job in enumerate(jobs)}
    jobs = sorted(jobs, key=lambda j: (-j[3], -len(j[4])))
    context = multiprocessing.get_context("spawn")  # a forked process would inherit XLA's threads
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
      futures = [pool.submit(_run_job, job, traces[job[0]], shapes.get(job[0]),
                             hot_profiles.get(job[0])) for job in jobs]
      for future in concurrent.futures.as_completed(futures):
        rows.extend(future.result())
        bar.update()
    rows.sort(key=lambda r: order[r.trace, r.policy, r.cache_fraction])
  else:
    for job in jobs:
      rows.extend(_run_job(job, traces[job[0]], shapes.get(job[0]), hot_profiles.get(job[0])))
      bar.update()
  bar.close()
  if bound_samples > 0:
    rows = _with_bounds(rows, traces, fractions, hardware, shapes, bound_samples, progress)
  return rows


def _with_bounds(rows, traces, fractions, hardware, shapes, samples, progress):
  """``rows`` with each synthetic trace's bound rows after its rows of each size."""
  extra: dict[tuple[str, float], list[SweepRow]] = {}
  for name, trace in traces.items():
    if (trace.metadata.get("source") != "ftjax.research.synthetic" or
        "held_out_steps" in trace.metadata):  # no known law, or a generated trace's tail
      continue
    law = synthetic.next_step_probabilities(trace, samples=samples, progress=progress)
    for fraction in fractions:
      slots = int(round(fraction * trace.num_layers * trace.num_experts))
      b = online_bound(trace, law, slots)
      new = [SweepRow(trace=name, policy=ONLINE_BOUND, hardware="", cache_fraction=fraction,
                      cache_slots=slots, miss_rate=b.miss_rate, per_layer_miss_rate=[])]
      shape, misses = shapes.get(name), b.routed - b.prescient_hits
      for hw in hardware:  # without a shape only the miss rate is reported
        fills, host = (best_split(hw, shape, b.prescient_hits, misses) if shape is not None
                       else (np.zeros_like(misses), misses))
        result = ReplayResult(PRESCIENT, slots, b.prescient_hits, fills, host)
        new.append(_row(name, PRESCIENT, hw.name, fraction, result, trace, shape,
                        hw if shape is not None else None))
      extra[name, fraction] = new
  out = []
  for i, row in enumerate(rows):  # after the last row of each (trace, size)
    out.append(row)
    key = (row.trace, row.cache_fraction)
    if key in extra and (i + 1 == len(rows) or (rows[i + 1].trace, rows[i + 1].cache_fraction)
                         != key):
      out.extend(extra.pop(key))
  return out


def _job_key(job) -> tuple[str, str, float]:
  """(trace, row label, cache fraction) of a job: the label is ``POLICY+PREFETCH`` with
  prefetch."""
  name, policy, fraction = job[:3]
  return name, policy if len(job) < 6 else f"{policy}+{job[5]}", fraction


def _cost(pf, hw, shape):
  """The (hardware, shape) a prefetch's "link" budget is sized by (one profile per job)."""
  if pf is None or pf.budget != "link":
    return None
  if shape is None:
    raise ValueError(f"prefetch {pf} sizes its budget by the cost model: the trace needs a "
                     "model shape (--model_shape), or give an int budget (PREDICTOR@8)")
  return hw, shape


def _run_job(job, trace: Trace, shape, hot_profile) -> list[SweepRow]:
  """The rows of one sweep job: a policy at one cache size under a list of profiles (a q*
  policy: a list of groups of profiles with equal fill tables), with a prefetch when the job
  names one, or Belady's bound."""
  name, policy, fraction, slots, group = job[:5]
  pf = job[5] if len(job) > 5 else None
  if policy == "belady":
    requests = sum(len(np.unique(r[r >= 0])) for step in trace.ids for r in step)
    misses = belady_misses(trace, slots, preload=True)  # also bounds the static policies
    return [SweepRow(trace=name, policy="belady", hardware="", cache_fraction=fraction,
                     cache_slots=slots, miss_rate=misses / max(requests, 1),
                     per_layer_miss_rate=[])]
  label = _job_key(job)[1]
  if policy != ORACLE and get_policy(policy).fill_rule == "q*":
    results = replay_many(trace, policy, slots, [(g[0].b_p, g[0].b_h) for g in group],
                          prefetch=pf, cost=_cost(pf, group[0][0], shape))
    return [_row(name, label, hw.name, fraction, result, trace, shape, hw)
            for result, g in zip(results, group) for hw in g]
  bw = (group[0].b_p, group[0].b_h)
  if policy == ORACLE:
    result = replay(trace, "static_hot", slots, bw, hot_experts=expert_counts(trace))
  else:
    result = replay(trace, policy, slots, bw, hot_experts=hot_profile, prefetch=pf,
                    cost=_cost(pf, group[0], shape))
  return [_row(name, label, hw.name, fraction, result, trace, shape, hw) for hw in group]


# ---------------------------------------------------------------------------- outputs


def write_csv(rows: Sequence[SweepRow], out_dir: str) -> tuple[str, str]:
  """``results.csv`` (one row per result) and ``per_layer.csv`` (miss rate per layer)."""
  os.makedirs(out_dir, exist_ok=True)
  main, per_layer = os.path.join(out_dir, "results.csv"), os.path.join(out_dir, "per_layer.csv")
  with open(main, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(SweepRow.CSV_FIELDS)
    for r in rows:
      w.writerow([_fmt(getattr(r, k)) for k in SweepRow.CSV_FIELDS])
  with open(per_layer, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(("trace", "policy", "hardware", "cache_fraction", "layer", "miss_rate"))
    for r in rows:
      for layer, rate in enumerate(r.per_layer_miss_rate):
        w.writerow((r.trace, r.policy, r.hardware, _fmt(r.cache_fraction), layer, _fmt(rate)))
  return main, per_layer


def _fmt(v):
  if isinstance(v, float):
    return "" if np.isnan(v) else f"{v:.6g}"
  return v


def plot(rows: Sequence[SweepRow], out_dir: str, *, reference_hardware: str | None = None
         ) -> list[str]:
  """Per trace: miss rate vs cache size per policy (q* policies under
  ``reference_hardware``, default the first profile) with Belady's bound, and modeled tok/s vs
  cache size per hardware profile. Needs matplotlib (``pip install 'ftjax[plot]'``)."""
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError as e:
    raise ImportError("plots need matplotlib: pip install matplotlib (or 'ftjax[plot]'); "
                      "the CSV files are written without it") from e
  paths = []
  for trace in dict.fromkeys(r.trace for r in rows):
    trows = [r for r in rows if r.trace == trace]
    hws = list(dict.fromkeys(r.hardware for r in trows if r.hardware))
    ref = reference_hardware or (hws[0] if hws else "")
    policies = list(dict.fromkeys(r.policy for r in trows))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for policy in policies:
      pts = sorted((r.cache_fraction, r.miss_rate) for r in trows
                   if r.policy == policy and r.hardware in (ref, ""))
      if pts:
        x, y = zip(*pts)
        style = (dict(ls="--", color="black") if policy == "belady" else
                 dict(ls="-.", color="black") if policy == ONLINE_BOUND else
                 dict(ls=":", color="black") if policy == PRESCIENT else
                 dict(ls=":", color="grey") if policy == ORACLE else {})
        ax.plot(np.asarray(x) * 100, np.asarray(y) * 100, marker="o", ms=3, label=policy,
                **style)
    ax.set(xlabel="cache size (% of all experts)", ylabel="miss rate (%)",
           title=f"{trace}: miss rate vs cache size\n(q* policies with {ref}'s bandwidths)")
    ax.axvline(37, color="grey", lw=0.6, ls=":")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"miss_rate_{trace}.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    if not hws:
      continue
    cols = min(4, len(hws))
    nrows = -(-len(hws) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.0 * nrows), squeeze=False)
    for ax, hw in zip(axes.flat, hws):
      for policy in policies:
        pts = sorted((r.cache_fraction, r.modeled_tok_s) for r in trows
                     if r.policy == policy and r.hardware == hw)
        if pts:
          x, y = zip(*pts)
          style = dict(ls=":", color="black") if policy == PRESCIENT else {}
          ax.plot(np.asarray(x) * 100, y, marker="o", ms=2, label=policy, **style)
      ax.set_title(hw, fontsize=9)
      ax.set_xlabel("cache size (% of experts)", fontsize=8)
      ax.set_ylabel("modeled tok/s", fontsize=8)
      ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(hws):]:
      ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{trace}: modeled decode tok/s (ftjax.research.cost)", fontsize=10)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"tok_s_{trace}.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
  return paths


def summary(rows: Sequence[SweepRow]) -> dict:
  """JSON-friendly: every row without the per-layer lists (those are in per_layer.csv)."""
  out = []
  for r in rows:
    d = dataclasses.asdict(r)
    d.pop("per_layer_miss_rate")
    out.append({k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in d.items()})
  return {"rows": out}


# ---------------------------------------------------------------------------- CLI


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  try:
    fractions = [float(x) for x in _FRACTIONS.value]
    if not all(0.0 <= f <= 1.0 for f in fractions):
      raise ValueError(f"cache fractions must be in [0, 1], got {fractions}")
    for p in _POLICIES.value:
      get_policy(p)
    traces, profiles = load_traces_and_profiles(
        _TRACES.value, seed=_SEED.value, synthetic_steps=_STEPS.value,
        synthetic_prefill=_PREFILL.value, holdout=_HOLDOUT.value,
        synthetic_recall=_RECALL.value)
    hardware = load_hardware(_HARDWARE.value)
    shapes = {name: trace_shape(t, _SHAPE.value) for name, t in traces.items()}
    for name, t in traces.items():
      print(f"{name}: {t.num_steps} steps x {t.num_layers} layers x top-{t.top_k} of "
            f"{t.num_experts}; modeled as {shapes[name].name}", file=sys.stderr)
    prefetch = [Prefetch.parse(p) for p in _PREFETCH.value]
    rows = sweep(traces, _POLICIES.value, fractions, hardware, shapes, belady=_BELADY.value,
                 hot_profiles=profiles, bound_samples=_BOUND_SAMPLES.value, prefetch=prefetch)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"ftjax.sweep: error: {e}") from None
  paths = list(write_csv(rows, _OUT.value))
  with open(os.path.join(_OUT.value, "summary.json"), "w") as f:
    json.dump({"traces": {n: {"steps": t.num_steps, "layers": t.num_layers,
                              "experts": t.num_experts, "top_k": t.top_k,
                              "shape": shapes[n].to_dict()} for n, t in traces.items()},
               "hardware": [h.to_dict() for h in hardware], "seed": _SEED.value,
               **summary(rows)}, f, indent=1)
  paths.append(os.path.join(_OUT.value, "summary.json"))
  if _PLOTS.value:
    try:
      paths += plot(rows, _OUT.value)
    except ImportError as e:
      print(f"ftjax.sweep: {e}", file=sys.stderr)
  print("\n".join(f"wrote {p}" for p in paths))


def cli() -> None:
  """``python -m ftjax.sweep``: defines the flags (only here, so that importing the library
  defines none) and runs ``main``."""
  global _TRACES, _FRACTIONS, _POLICIES, _HARDWARE, _SHAPE, _OUT, _SEED, _STEPS, _PREFILL
  global _BELADY, _PLOTS, _HOLDOUT, _BOUND_SAMPLES, _PREFETCH, _RECALL
  _TRACES = flags.DEFINE_list("traces", ["default"],
                              "trace files (.npz, globs), synthetic:NAME (qwen3-30b-a3b) and/or "
                              "default (routing of the embedded default model)")
  _FRACTIONS = flags.DEFINE_list("cache_fractions", [str(f) for f in DEFAULT_FRACTIONS],
                                 "cache sizes as fractions of all experts")
  _POLICIES = flags.DEFINE_list("policies", list(POLICIES), "cache policies to replay")
  _HARDWARE = flags.DEFINE_list("hardware", ["configs/hardware/*.yaml"],
                                "hardware profile YAML files (globs allowed)")
  _SHAPE = flags.DEFINE_string("model_shape", None, "config.json of the modeled model "
                               "(default: the trace's own config, or configs/models/NAME.json)")
  _OUT = flags.DEFINE_string("out", "sweep_out", "output directory")
  _SEED = flags.DEFINE_integer("seed", 0, "seed of synthetic traces")
  _STEPS = flags.DEFINE_integer("synthetic_steps", 2000, "decode steps of synthetic traces",
                                lower_bound=1)
  _PREFILL = flags.DEFINE_integer("synthetic_prefill", 0, "prefill steps of synthetic traces",
                                  lower_bound=0)
  _BELADY = flags.DEFINE_bool("belady", True, "include Belady's offline bound")
  _BOUND_SAMPLES = flags.DEFINE_integer(
      "bound_samples", 256, "synthetic traces: samples of each step's routing law for the "
      "online bound and the prescient placement (ftjax.research.bound); 0 leaves them out",
      lower_bound=0)
  _HOLDOUT = flags.DEFINE_float("holdout", DEFAULT_HOLDOUT,
                                "static_hot's routing profile of a trace file: this leading "
                                "fraction of its steps, cut from the replayed part (synthetic "
                                "traces: another seed)", lower_bound=0.01, upper_bound=0.99)
  _PLOTS = flags.DEFINE_bool("plots", True, "write PNG plots (needs matplotlib)")
  _PREFETCH = flags.DEFINE_list(
      "prefetch", [], "also replay each policy that starts empty with these prefetches, "
      "PREDICTOR[@BUDGET]: trace (the trace's predicted ids), cooccurrence (learned online "
      "from the ids), last_token; BUDGET = fills per layer-step, own fills first (default "
      "top_k). E.g. --prefetch=trace,cooccurrence@4")
  _RECALL = flags.DEFINE_float(
      "synthetic_recall", None, "synthetic traces carry the predictions of a modelled "
      "predictor of this recall (ftjax.research.synthetic.with_predictions; router-ahead "
      "measured 0.71 a layer ahead, 0.87-0.90 a sublayer ahead), for --prefetch=trace",
      lower_bound=0.0, upper_bound=1.0)
  app.run(main)


if __name__ == "__main__":
  cli()
