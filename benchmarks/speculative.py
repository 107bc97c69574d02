"""MTP speculative decoding on the 4-layer Qwen3.5-35B-A3B-shaped hybrid bench model (issue 30):
the cost of a verify step against a plain step, with the distinct experts it reads, and the
adaptive draft length's tok/s against fixed draft lengths at chosen acceptance rates.

The model: ``hybrid_e2e.hf_config(4)`` (three Gated-DeltaNet layers and one gated
full-attention layer, 256 experts top-8, a shared expert, vocabulary 248,320) with one MTP
layer (``mtp_num_hidden_layers=1``: the head's fc, norms and a full-attention MoE layer whose
256 experts are a fifth bank layer), random bfloat16 weights written once as FTW into
``--model_dir`` (never committed). Kernels: ``--kernels``, by default ``ffi``, the exact ones:
with ``ffi_bf16`` (``auto`` on AVX-512-BF16) the activations' bf16 rounding differs between a
one-token step and a k + 1-token verify, and on this random model, whose top logits often lie
within that rounding, the verify then picks other tokens than plain decoding and the forced
drafts stop matching (decode runs at the read bandwidth either way).

A random head's drafts are almost never the model's tokens, so acceptance is set the way the
issue asks: the draft proposing emitted token i is forced (``forced_drafts``) to the plain
greedy token i with probability alpha, else to another token; the head still runs its own
draft steps, so each step costs what a real one does. The tokens forced are each k's own:
those its verify emits with every draft kept (``own_tokens``, a fixed point: the plain greedy
tokens unless a float32 near-tie between the k + 1-token verify and the one-token step parts
them, recorded in ``parted_from_plain_at``). A run that leaves them anyway (the adaptive rule's
verify lengths vary) is reported with the position, and from there its forced drafts no
longer match.

``--ftw DIR`` runs an FTW model with an MTP head instead: ``paper_model.py``'s full-depth
Qwen3.6-35B-A3B-shaped 4-bit conversion (issue 51, item 6), at acceptance 0, 0.3, 0.5, 0.7, 0.8
and 0.9, results in ``results/speculative_paper_model.{json,png}``.

Per round (``--rounds``, the configurations in alternating order, medians; one discarded
round first, which compiles):

- plain decode: ``Engine.generate_timed``, decode tok/s (first token left out);
- the verify step's cost for k = 1 .. 4 (every draft forced right: each step verifies k + 1
  tokens): seconds per verify step against a plain step's, and the distinct routed experts
  the k + 1 tokens read in the decoder's layers, counted from a routing record of the plain
  run (the same tokens at the same positions), against one token's;
- at acceptance 0.5, 0.7 and 0.9: tok/s of fixed k = 1 .. 4 and of the adaptive rule
  (``adaptive=True``, up to 4 drafts), with the draft lengths the rule chose;
- the head's own drafts (no forcing; a random head): tok/s of k = 2 and of the adaptive rule.

On a 4-layer model the head's draft steps are expensive: each reads the lm_head (1.02 GB of
1.5 GB a plain step reads), so drafting pays only at high acceptance; the results also give
the cost model's (``speculative.step_costs``) bytes per step for each k, against the measured
seconds.

  /work/venv/bin/python benchmarks/speculative.py          # ~15 min (+~3 min to write the model)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, pyplot, write_results  # noqa: E402

ALPHAS = (0.5, 0.7, 0.9)
FULL_DEPTH_ALPHAS = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9)  # --ftw: "at every acceptance", and 0.8
KS = (1, 2, 3, 4)
SETTLE_TRIES = 8  # runs of the fixed-point search for each k's own tokens


def log(msg: str) -> None:
  print(f"[speculative] {msg}", file=sys.stderr, flush=True)


def load(layers: int, model_dir: str):
  from batch_decode import load_or_write  # noqa: PLC0415
  from ftjax.model.config import ModelConfig  # noqa: PLC0415
  from hybrid_e2e import hf_config  # noqa: PLC0415
  config = ModelConfig.from_hf_config(hf_config(layers, mtp_num_hidden_layers=1))
  return load_or_write(config, os.path.join(model_dir, f"hybrid-mtp-{layers}l"), log)


def distinct_experts(routing: list, k: int) -> float:
  """Mean over the windows of k + 1 consecutive decoded tokens of the distinct experts their
  routes reach, summed over the decoder's layers (``routing``: [L, 1, top_k] per token)."""
  import numpy as np  # noqa: PLC0415
  ids = np.concatenate(routing, axis=1)  # [L, T, top_k]
  counts = []
  for t in range(ids.shape[1] - k):
    window = ids[:, t:t + k + 1]
    counts.append(sum(len(np.unique(w[w >= 0])) for w in window))
  return float(np.mean(counts))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--tokens", type=int, default=64, help="new tokens per run")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--model_dir", default="/tmp/ftjax-spec-bench")
  p.add_argument("--kernels", default="ffi")
  p.add_argument("--ftw", default=None,
                 help="an FTW model with an MTP head to run instead of the generated one: "
                      "paper_model.py's full-depth Qwen3.6-35B-A3B-shaped conversion (issue "
                      "51), at acceptance 0, 0.3, 0.5, 0.7, 0.8 and 0.9")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  from ftjax.runtime.speculative import step_costs  # noqa: PLC0415
  alphas = FULL_DEPTH_ALPHAS if args.ftw else ALPHAS
  if args.ftw:
    model = ftjax.load(args.ftw, verify=False, populate=True)
  else:
    os.makedirs(args.model_dir, exist_ok=True)
    model = load(args.layers, args.model_dir)
  c = model.config
  engine = ftjax.Engine(model, max_seq_len=512, kernels=args.kernels)
  log(f"kernels: {engine.kernels_path}")
  ids = np.random.default_rng(0).integers(0, c.vocab_size, 16).tolist()
  n = args.tokens
  plain = np.asarray(engine.generate(ids, n, greedy=True))

  counter = ftjax.Engine(model, max_seq_len=512, record_routing=True, kernels=args.kernels)
  if counter.generate(ids, n, greedy=True) != plain.tolist():
    raise RuntimeError("the routing-recording engine decoded other tokens")
  routing = [r for r, _, phase in counter.executor.routing if phase == "decode"]
  distinct = {k: distinct_experts(routing, k) for k in (0,) + KS}
  del counter

  def own_tokens(k: int) -> np.ndarray:
    """The tokens a k-draft verify emits with every draft forced to the tokens it emits: the
    plain greedy tokens, unless a near-tie between the (k + 1)-token verify's and the
    one-token step's float32 sums parts them (on a random model at 40 layers, at token 4 of
    the 4-bit conversion); then the forced drafts follow the verify's own tokens from there,
    so that forcing sets the acceptance it names. A fixed point, reached in a few runs."""
    ref, seen = plain, []
    for _ in range(SETTLE_TRIES):
      got = np.asarray(engine.generate_speculative(ids, n, draft_tokens=k,
                                                   forced_drafts=ref).tokens)
      if np.array_equal(got, ref):
        settled[k] = True
        return ref
      seen.append(ref)
      ref = got
    # No fixed point (a cycle: which drafts a step keeps moves where the near-tie falls): the
    # last run's tokens are forced, and the acceptance each run measured is reported beside
    # the one it was forced to.
    log(f"k={k}: the forced tokens did not settle in {SETTLE_TRIES} runs; forcing the last")
    settled[k] = False
    return ref

  settled: dict[int, bool] = {}
  own = {k: own_tokens(k) for k in KS}
  parted = {k: next((i for i, (a, b) in enumerate(zip(own[k], plain)) if a != b), None)
            for k in KS}
  log(f"where each k's verify parts from plain greedy (near-ties): {parted}")
  rng = np.random.default_rng(1)
  draws = rng.random(n)
  forced = {(k, 1.0): own[k] for k in KS}
  for a in alphas:
    for k in KS:  # the same draws for every k: the same positions kept
      forced[(k, a)] = np.where(draws < a, own[k], (own[k] + 1) % c.vocab_size)
  configs = [("plain", None, None, False)]
  configs += [(f"k={k} all kept", k, 1.0, False) for k in KS]
  for a in alphas:
    configs += [(f"k={k} alpha={a}", k, a, False) for k in KS]
    configs.append((f"adaptive alpha={a}", 4, a, True))
  configs += [("k=2 head", 2, None, False), ("adaptive head", 4, None, True)]

  def run(cfg) -> dict:
    name, k, alpha, adaptive = cfg
    if k is None:
      r = engine.generate_timed(ids, n, greedy=True)
      if r.tokens != plain.tolist():
        raise RuntimeError("plain decode changed its tokens")
      return {"tok_s": (len(r.tokens) - 1) / r.decode_s, "step_s": r.decode_s / (n - 1)}
    r = engine.generate_speculative(
        ids, n, draft_tokens=k, adaptive=adaptive,
        forced_drafts=None if alpha is None else forced[(k, alpha)])
    differs = next((i for i, (a, b) in enumerate(zip(r.tokens, own[k].tolist())) if a != b),
                   None)
    if differs is not None and alpha is not None:
      log(f"{name}: the tokens leave the forced reference's at token {differs} (a near-tie)")
    drafted = sum(r.lengths[1:]) if adaptive else r.steps
    return {"tok_s": r.decode_tok_s, "step_s": r.decode_s / r.steps, "steps": r.steps,
            "tokens_per_step": r.tokens_per_step, "accepted": r.accepted,
            "first_draft_acceptance": r.accepted[0] / drafted if drafted else None,
            "lengths": r.lengths, "costs_s": r.costs, "differs_at": differs}

  log(f"warm-up round (compiles): {len(configs)} configurations")
  for cfg in configs:
    run(cfg)
  rounds = []
  for i in range(args.rounds):
    order = configs if i % 2 == 0 else configs[::-1]
    row = {cfg[0]: run(cfg) for cfg in order}
    log(f"round {i + 1}: plain {row['plain']['tok_s']:.1f} tok/s; "
        + ", ".join(f"{a}: adaptive {row[f'adaptive alpha={a}']['tok_s']:.1f}" for a in alphas))
    rounds.append(row)

  def med(name: str, key: str) -> float:
    return statistics.median(r[name][key] for r in rounds)

  costs = step_costs(model, max(KS))
  plain_step = med("plain", "step_s")
  verify = {}
  for k in KS:
    name = f"k={k} all kept"
    verify[k] = {"step_s": med(name, "step_s"), "of_plain_step": med(name, "step_s") / plain_step,
                 "tokens_per_step": rounds[0][name]["tokens_per_step"],
                 "distinct_experts": distinct[k], "distinct_of_one_token": distinct[k] / distinct[0],
                 "modelled_bytes": float(costs[k]),
                 "modelled_of_plain": float(costs[k] / costs[0])}
  at = {}
  for a in alphas:
    fixed = {k: med(f"k={k} alpha={a}", "tok_s") for k in KS}
    ad = f"adaptive alpha={a}"
    at[str(a)] = {"fixed_tok_s": fixed, "adaptive_tok_s": med(ad, "tok_s"),
                  "best_fixed_k": max(fixed, key=fixed.get),
                  "adaptive_of_best_fixed": med(ad, "tok_s") / max(fixed.values()),
                  "adaptive_of_plain": med(ad, "tok_s") / med("plain", "tok_s"),
                  "adaptive_lengths": rounds[-1][ad]["lengths"],
                  "adaptive_costs_s": rounds[-1][ad]["costs_s"],
                  "measured_first_draft_acceptance": {
                      k: rounds[-1][f"k={k} alpha={a}"]["first_draft_acceptance"] for k in KS},
                  "accepted_fixed": {k: rounds[-1][f"k={k} alpha={a}"]["accepted"] for k in KS}}
  head = {name: {"tok_s": med(name, "tok_s"), "lengths": rounds[-1][name].get("lengths"),
                 "accepted": rounds[-1][name]["accepted"]}
          for name in ("k=2 head", "adaptive head")}
  results = {"benchmark": "speculative", "machine": machine_info(),
             "model": args.ftw or "generated", "dense": model.dense_formats,
             "experts_format": model.expert_format,
             "kernels": engine.kernels_path, "layers": c.num_layers, "mtp_layers": c.mtp_layers,
             "experts": c.num_experts, "top_k": c.top_k, "tokens": n,
             "plain_tok_s": med("plain", "tok_s"), "plain_step_s": plain_step,
             "distinct_experts_one_token": distinct[0], "modelled_plain_bytes": float(costs[0]),
             "verify": verify, "acceptance": at, "head_drafts": head, "rounds": rounds,
             "parted_from_plain_at": {str(k): v for k, v in parted.items()},
             "own_tokens_settled": {str(k): v for k, v in settled.items()}}

  print(f"\nplain decode {results['plain_tok_s']:.2f} tok/s, {plain_step * 1e3:.1f} ms a step, "
        f"{distinct[0]:.0f} distinct experts a token over {c.num_layers} layers")
  print(f"{'k':>2} {'verify ms':>9} {'of plain':>8} {'experts':>8} {'of one':>7} "
        f"{'modelled':>8}")
  for k, v in verify.items():
    print(f"{k:>2} {v['step_s'] * 1e3:9.1f} {v['of_plain_step']:8.2f} "
          f"{v['distinct_experts']:8.1f} {v['distinct_of_one_token']:7.2f} "
          f"{v['modelled_of_plain']:8.2f}")
  print(f"\n{'alpha':>5} " + " ".join(f"{'k=' + str(k):>6}" for k in KS)
        + f" {'adaptive':>8} {'of best':>7} {'of plain':>8}  lengths 0..4")
  for a, v in at.items():
    print(f"{a:>5} " + " ".join(f"{v['fixed_tok_s'][k]:6.1f}" for k in KS)
          + f" {v['adaptive_tok_s']:8.1f} {v['adaptive_of_best_fixed']:7.2f} "
          f"{v['adaptive_of_plain']:8.2f}  {v['adaptive_lengths']}")
  for name, v in head.items():
    print(f"{name}: {v['tok_s']:.1f} tok/s, accepted {v['accepted']}, lengths {v['lengths']}")
  path = write_results("speculative_paper_model" if args.ftw else "speculative", results,
                       args.out)
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(7, 4))
  xs = [float(a) for a in at]
  for k in KS:
    ax.plot(xs, [at[a]["fixed_tok_s"][k] for a in at], "o--", label=f"k={k}")
  ax.plot(xs, [at[a]["adaptive_tok_s"] for a in at], "s-", lw=2, color="black", label="adaptive")
  ax.axhline(results["plain_tok_s"], color="gray", lw=1, label="plain decode")
  ax.set_xlabel("acceptance per draft position (forced drafts)")
  ax.set_ylabel("decode tok/s")
  ax.set_title(f"MTP speculative decoding, {c.num_layers}-layer "
               + ("Qwen3.6-35B-A3B shape, 4-bit" if args.ftw else "hybrid bench model"))
  ax.legend(fontsize=8)
  fig.tight_layout()
  png = path[:-len(".json")] + ".png"
  fig.savefig(png, dpi=120)
  print(f"wrote {path} and {png}")


if __name__ == "__main__":
  main()
