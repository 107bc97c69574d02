"""Host attention kernel benchmark: ftjax_attention's decode form against the read bandwidth
measured in the same run, and its prefill form.

Shapes are Qwen3-30B-A3B's attention: H = 32 query heads, G = 4 kv heads, A = 128.

  read       ftjax.kernels.read_probe over a 1 GiB buffer (the read-bandwidth ceiling)
  decode     T = 1 against a full cache of S rows (length = S), float32 and bfloat16 caches; the
             calls rotate over enough caches (>= 96 MiB of K + V) that none is served from the
             32 MiB L3. GB/s = K + V bytes of the S rows / seconds (1 GB = 1e9 bytes).
  prefill    T = 2048 queries at S = length = 2048 (a fresh causal prefill chunk), bf16 cache.

Every ratio is taken within one round and the table reports medians over the rounds.

A/B: `--ab DIR` alternates rounds of the installed module with rounds of a copy of another build
of ftjax._ffi in DIR (each round its own process), for a before/after table from one session:

  python benchmarks/attention_kernel.py [--rounds 5] [--ab /tmp/base_ffi_dir]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

H, G, A = 32, 4, 128
DECODE_ROWS = (4096, 32768)
PREFILL_T = 2048
READ_BYTES = 1 << 30
ROTATION_BYTES = 96 << 20


def load_ffi_from(directory):
  """Makes `import ftjax._ffi` load the module file in `directory` (an A/B baseline)."""
  (name,) = [f for f in os.listdir(directory) if f.startswith("_ffi.") and f.endswith(".so")]
  spec = importlib.util.spec_from_file_location("ftjax._ffi", os.path.join(directory, name))
  module = importlib.util.module_from_spec(spec)
  sys.modules["ftjax._ffi"] = module
  spec.loader.exec_module(module)


def timed(fn, calls):
  """Median seconds of `calls` calls, each waited for (so that Python's dispatch does not take a
  core from the kernel's threads while it runs)."""
  import jax  # noqa: PLC0415

  seconds = []
  for i in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(fn(i))
    seconds.append(time.perf_counter() - start)
  return statistics.median(seconds)


def one_round(repeats):
  """Times every case once (median of `repeats`) in this process; returns {name: value}."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from ftjax import kernels  # noqa: PLC0415

  rng = np.random.default_rng(0)
  attend = jax.jit(kernels.attention, static_argnames=("scale",))
  read_probe = jax.jit(kernels.read_probe)
  m = {"isa": kernels.cpu_info()["isa"]}

  buffer = jnp.asarray(rng.integers(0, 2**31, READ_BYTES // 4, dtype=np.uint32))
  read_probe(buffer).block_until_ready()
  m["read_GBps"] = READ_BYTES / statistics.median(
      timed(lambda i: read_probe(buffer), 3) for _ in range(repeats)) / 1e9
  buffer = None  # frees the 1 GiB before the caches are made

  for S in DECODE_ROWS:
    for dtype_name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
      kv_bytes = 2 * S * G * A * jnp.dtype(dtype).itemsize
      copies = max(1, -(-ROTATION_BYTES // kv_bytes))
      caches = [(jnp.asarray(rng.standard_normal((1, S, G, A), np.float32), dtype),
                 jnp.asarray(rng.standard_normal((1, S, G, A), np.float32), dtype))
                for _ in range(copies)]
      q = jnp.asarray(rng.standard_normal((1, 1, H, A), np.float32))

      def run(i, caches=caches, q=q, S=S):
        k, v = caches[i % len(caches)]
        return attend(q, k, v, S, scale=A**-0.5)

      run(0).block_until_ready()
      seconds = timed(run, 4 * copies * repeats)
      name = f"decode_S{S}_{dtype_name}"
      m[f"{name}_us"] = seconds * 1e6
      m[f"{name}_GBps"] = kv_bytes / seconds / 1e9
      m[f"{name}_of_read"] = m[f"{name}_GBps"] / m["read_GBps"]
      del caches

  k = jnp.asarray(rng.standard_normal((1, PREFILL_T, G, A), np.float32), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((1, PREFILL_T, G, A), np.float32), jnp.bfloat16)
  q = jnp.asarray(rng.standard_normal((1, PREFILL_T, H, A), np.float32))
  attend(q, k, v, PREFILL_T, scale=A**-0.5).block_until_ready()
  m["prefill_T2048_bf16_ms"] = 1e3 * statistics.median(
      timed(lambda i: attend(q, k, v, PREFILL_T, scale=A**-0.5), 1) for _ in range(repeats))
  return m


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--repeats", type=int, default=5, help="timings per case within a round")
  parser.add_argument("--ab", default=None, help="directory holding a baseline ftjax._ffi")
  parser.add_argument("--ffi", default=None, help=argparse.SUPPRESS)  # one round, this module
  parser.add_argument("--out", default="benchmarks/results/attention_kernel.json")
  args = parser.parse_args(argv)

  if args.ffi is not None:  # a child round
    if args.ffi != "installed":
      load_ffi_from(args.ffi)
    print(json.dumps(one_round(args.repeats)))
    return

  variants = {"after": "installed"} if args.ab is None else {"before": args.ab,
                                                             "after": "installed"}
  rounds = {name: [] for name in variants}
  for r in range(args.rounds):
    for name, ffi in variants.items():
      out = subprocess.run([sys.executable, __file__, "--ffi", ffi, "--repeats",
                            str(args.repeats)], check=True, capture_output=True, text=True)
      m = json.loads(out.stdout.strip().splitlines()[-1])
      rounds[name].append(m)
      print(f"round {r} {name}: " + ", ".join(
          f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()),
          flush=True)

  medians = {name: {k: statistics.median(m[k] for m in ms) for k in ms[0] if k != "isa"}
             for name, ms in rounds.items()}
  for name, med in medians.items():
    med["isa"] = rounds[name][0]["isa"]
  print(json.dumps(medians, indent=1))

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from common import machine_info  # noqa: PLC0415

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"machine": machine_info(), "medians": medians, "rounds": rounds}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
