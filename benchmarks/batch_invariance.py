"""What batch invariance costs, and whether it holds (issue 54, item 5).

The expert kernel's decode form (``xla_ffi/expert_ffn.cc``, T <= 8 tokens a call) runs each
route of an expert as a one-token dot of its own, over sub-tiles that stay in L2, so that a
token's sums never depend on how many other tokens of its batch chose the same expert. This
measures, against a build from before that change (``--baseline DIR``: a folder holding an
older ftjax, e.g. ``git stash; pip install --no-deps --no-build-isolation --target DIR .``):

- ``kernel``: decode-form ``expert_ffn`` calls at Qwen3-30B-A3B's expert shapes (D 2048, F 768,
  128 experts, top-8, one layer's bf16 bank, 1.2 GB), T = 1, 4 and 8 tokens routed by a
  Zipf-like popularity (as a trained router's: several tokens share experts), with bf16 and
  float32 activations; each build in its own process, alternating, ``--rounds`` rounds,
  medians of per-call medians;
- ``invariance``: the embedded models' executor decoding 8 sequences (greedy and seeded,
  alternating) in a batch of 8 rows, and each alone in a batch of 8 rows, default kernels,
  under this machine's kernel tuning and under the kernels' shipped defaults (the one-token
  kernel's accumulators decide whether the old decode form's orders differed): sequences whose
  tokens differ, and the largest difference of their chosen tokens' log-probabilities.

Writes ``results/batch_invariance.json``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402

D, F, E, K = 2048, 768, 128, 8


def kernel_times() -> dict:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import ml_dtypes  # noqa: PLC0415

  from ftjax.kernels import expert_ffn  # noqa: PLC0415

  rng = np.random.default_rng(0)
  bits = rng.integers(0x3a00, 0x3d00, size=(1, E, 3 * F * D), dtype=np.uint16)
  bits |= rng.integers(0, 2, size=bits.shape, dtype=np.uint16) << 15  # signs
  bank = jnp.asarray(bits.view(ml_dtypes.bfloat16))
  popularity = 1.0 / np.arange(1, E + 1) ** 0.8
  popularity /= popularity.sum()
  out = {}
  for bf16 in (True, False):
    call = jax.jit(lambda x, i, w, b, bf16=bf16: expert_ffn(x, i, w, b, 0, ffn_dim=F,
                                                           bf16_activations=bf16))
    for tokens in (1, 4, 8):
      medians, shared = [], []
      for _ in range(6):  # routings
        ids = np.stack([rng.choice(E, K, replace=False, p=popularity)
                        for _ in range(tokens)]).astype(np.int32)
        shared.append(tokens * K - len(np.unique(ids)))
        x = rng.standard_normal((tokens, D)).astype(np.float32)
        w = np.full((tokens, K), 1 / K, np.float32)
        call(x, ids, w, bank).block_until_ready()
        seconds = []
        for _ in range(15):
          t0 = time.perf_counter()
          call(x, ids, w, bank).block_until_ready()
          seconds.append(time.perf_counter() - t0)
        medians.append(float(np.median(seconds)))
      out[f"{'bf16' if bf16 else 'f32'}_activations_T{tokens}"] = {
          "ms": float(np.median(medians)) * 1e3, "routes_sharing_an_expert": float(np.mean(shared))}
  return out


def invariance() -> dict:
  import ftjax  # noqa: PLC0415
  from ftjax.runtime.executor import Feed, Generation  # noqa: PLC0415
  from ftjax.runtime.sampling import Sampling  # noqa: PLC0415

  class All(Feed):
    def __init__(self, generations):
      self.queue = list(generations)

    def ready(self, free):
      out, self.queue = self.queue[:free], self.queue[free:]
      return out

    def pending(self):
      return bool(self.queue)

    def work(self):
      return bool(self.queue)

  from ftjax.kernels import tuning  # noqa: PLC0415

  out = {}
  for name, tuned in (("default", "machine"), ("default-hybrid", "machine"),
                      ("default", "shipped"), ("default-hybrid", "shipped")):
    engine = ftjax.Engine(ftjax.load(name))
    if tuned == "shipped":  # the kernels' own defaults, not this machine's tuned variant
      tuning.apply(tuning.DEFAULT)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 400, size=int(rng.integers(5, 40)))) for _ in range(8)]
    samplings = [dict(greedy=True) if i % 2 == 0 else dict(greedy=False, temperature=0.9, seed=i)
                 for i in range(8)]
    new = 48

    def generation(prompt, sampling, engine=engine, new=new):
      read = engine.executor.extend(engine.new_state(1, len(prompt) + new + 1), prompt, start=0)
      return Generation(state=read.state, logits=read.logits, max_new=new,
                        sampling=Sampling.make(**sampling), stops=(),
                        on_chunk=lambda tokens, halted, layers: not halted, logprobs=[])

    alone = []
    for p, s in zip(prompts, samplings):
      g = generation(p, s)
      engine.executor.run(engine.executor.batch(8), All([g]))
      alone.append(g)
    together = [generation(p, s) for p, s in zip(prompts, samplings)]
    engine.executor.run(engine.executor.batch(8), All(together))
    differ, worst = 0, 0.0
    for a, b in zip(alone, together):
      differ += a.tokens != b.tokens
      n = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y),
               min(len(a.tokens), len(b.tokens)))
      if n:
        worst = max(worst, float(np.max(np.abs(
            np.array([e.logprob for e in a.logprobs[:n]]) -
            np.array([e.logprob for e in b.logprobs[:n]])))))
    out[f"{name}, {tuned} tuning"] = {
        "kernels": engine.kernels_path, "tuning": tuning.current().name, "sequences": 8,
        "tokens_differ": differ, "max_logprob_difference": worst}
    engine.close()
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--baseline", default=None,
                 help="a folder holding an ftjax build from before the change (PYTHONPATH)")
  p.add_argument("--rounds", type=int, default=3, help="kernel rounds (0: none)")
  p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child process's part
  p.add_argument("--out", default=None)
  args = p.parse_args()
  if args.part:
    print(json.dumps(kernel_times() if args.part == "kernel" else invariance()))
    return
  builds = {"current": None}
  if args.baseline:
    builds["baseline"] = os.path.abspath(args.baseline)

  def child(part, where):
    env = dict(os.environ)
    if where:
      env["PYTHONPATH"] = where + os.pathsep + env.get("PYTHONPATH", "")
    # Run from outside the checkout so the installed (or the baseline's) package is imported.
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--part", part],
                          env=env, cwd="/", capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])

  rounds = {b: [] for b in builds}
  for r in range(args.rounds):
    for b, where in (builds.items() if r % 2 == 0 else reversed(builds.items())):
      rounds[b].append(child("kernel", where))
      print(f"round {r + 1} {b}: " + ", ".join(f"{k} {v['ms']:.2f} ms"
                                               for k, v in rounds[b][-1].items()), flush=True)
  medians = {b: {k: float(np.median([x[k]["ms"] for x in rs])) for k in rs[0]}
             for b, rs in rounds.items() if rs}
  report = {"machine": machine_info(), "shapes": {"D": D, "F": F, "E": E, "K": K},
            "kernel_rounds": rounds, "kernel_median_ms": medians}
  if "baseline" in medians:
    report["kernel_ratio_current_over_baseline"] = {
        k: medians["current"][k] / medians["baseline"][k] for k in medians["current"]}
    for k, v in report["kernel_ratio_current_over_baseline"].items():
      print(f"{k}: {medians['baseline'][k]:.2f} -> {medians['current'][k]:.2f} ms (x{v:.3f})")
  report["invariance"] = {b: child("invariance", where) for b, where in builds.items()}
  for b, res in report["invariance"].items():
    for name, r in res.items():
      print(f"{b} {name}: {r['tokens_differ']} of 8 sequences differ from alone, "
            f"max |d logprob| {r['max_logprob_difference']:.3g}")
  print(write_results("batch_invariance", report, args.out))


if __name__ == "__main__":
  main()
