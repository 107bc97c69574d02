"""Start-up of ftjax's commands with the persistent compilation cache: cold, warm, and off.

  python benchmarks/compile_cache.py [--rounds=3]

For each embedded model, ``python -m ftjax.decode --max_new_tokens=16`` in a fresh process,
three ways, alternating within each round:

* cold: an empty ``FTJAX_CACHE_DIR`` (every program compiled, then stored);
* warm: the same directory again (every program loaded from the cache);
* off: ``--nocompilation_cache``.

Reported per way: the process's wall time (interpreter, jax and the model's loading
included), and the compile seconds the command itself reports (programs compiled or loaded
from the cache). Medians over rounds; writes ``results/compile_cache.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from common import machine_info, write_results

COMPILE = re.compile(r"\(compile ([\d.]+) s, not included[^)]*\)")


def run(model: str, cache_root: str, *flags: str) -> tuple[float, float]:
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["FTJAX_CACHE_DIR"] = cache_root
  t0 = time.perf_counter()
  done = subprocess.run([sys.executable, "-m", "ftjax.decode", f"--model={model}",
                         "--max_new_tokens=16", *flags], capture_output=True, text=True,
                        env=env, timeout=600, check=True)
  wall = time.perf_counter() - t0
  return wall, float(COMPILE.search(done.stderr).group(1))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--models", default="default,default-hybrid")
  args = parser.parse_args()
  results = {"machine": machine_info(), "command": "python -m ftjax.decode --max_new_tokens=16",
             "models": {}}
  for model in args.models.split(","):
    rows = {"cold": [], "warm": [], "off": []}
    for _ in range(args.rounds):
      root = tempfile.mkdtemp(prefix="ftjax-compile-cache-")
      try:
        rows["cold"].append(run(model, root))
        rows["warm"].append(run(model, root))
        rows["off"].append(run(model, root, "--nocompilation_cache"))
      finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {way: {"wall_s": statistics.median(w for w, _ in r),
                     "compile_s": statistics.median(c for _, c in r), "rounds": r}
               for way, r in rows.items()}
    results["models"][model] = summary
    print(f"{model}: " + "; ".join(f"{way} {s['wall_s']:.1f} s (compile {s['compile_s']:.2f} s)"
                                   for way, s in summary.items()), flush=True)
  print("wrote", write_results("compile_cache", results))


if __name__ == "__main__":
  main()
