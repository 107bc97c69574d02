"""The KV cache's write on XLA:CPU, one and two CPUs: the previous form against the current one,
then the server it slowed.

1. **The write alone**, in a process per CPU count (``taskset``), fresh compiles (JAX's cache
   off): a jitted step writing one row per sequence into the default model's 12 KV caches
   [B, 4096, 2, 64], donated, B = 1 (one length) and 4 (each sequence its own length):
   - ``previous``: the form before this benchmark (bfloat16 caches written through their
     uint16 bits by ``dynamic_update_slice``, one per sequence; reproduced here);
   - ``current``: ``ftjax.model.layers.write_kv`` on caches held as their bits (``KV_BITS``:
     one scatter of the B rows).
   Rounds alternate the two; medians. The ceiling is the write of the rows alone: 12 x B x 256
   bytes, nothing a step could do faster than ~microseconds, so the ratio printed is previous
   over current.
2. **The server**: ``python -m ftjax.serve --max_running 4`` on the default model, pinned to one
   CPU and on all, 4 concurrent greedy completions of 128 tokens (``openai`` client), the median
   of 3 rounds after a first (compiling) one. The previous build's numbers are not rerun here
   (they need that build); this session measured them with the same harness, two servers each,
   the rounds after the first: 87-106 tok/s on one CPU, 1,833-3,184 on two.

Run: ``python benchmarks/kv_write.py``. Writes ``results/kv_write.json`` with the machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, machine_info, write_results  # noqa: E402

CACHES, S, G, A = 12, 4096, 2, 64  # the default model: 6 layers x (k, v)


def _previous_write(buffer, rows, length):
  """The write before KV_BITS: a bfloat16 buffer, through its uint16 bits, one
  dynamic_update_slice per sequence."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  def put(buffer, rows, start):
    bits = jax.lax.dynamic_update_slice(
        jax.lax.bitcast_convert_type(buffer, jnp.uint16),
        jax.lax.bitcast_convert_type(rows.astype(jnp.bfloat16), jnp.uint16), start)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)

  if not jnp.ndim(length):
    return put(buffer, rows, (0, length, 0, 0))
  for b in range(buffer.shape[0]):
    buffer = put(buffer, rows[b:b + 1], (b, length[b], 0, 0))
  return buffer


def write_child(rounds: int, steps: int) -> dict:
  """In this process (its CPUs as taskset left them): ms per step of each form and B."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from ftjax.model.layers import KV_BITS, write_kv  # noqa: PLC0415

  out = {}
  for batch in (1, 4):
    length = (jnp.arange(batch, dtype=jnp.int32) * 37 + 5) if batch > 1 else jnp.int32(5)
    rows = jnp.ones((batch, 1, G, A), jnp.float32)
    forms = {}
    for name, fn in (("previous", _previous_write), ("current", write_kv)):
      step = jax.jit(lambda bufs, rows, length, fn=fn: [fn(b, rows, length) for b in bufs],
                     donate_argnums=0)
      dtype = jnp.bfloat16 if name == "previous" else KV_BITS
      bufs = [jnp.zeros((batch, S, G, A), dtype) for _ in range(CACHES)]
      bufs = step(bufs, rows, length)
      jax.block_until_ready(bufs)
      forms[name] = [step, bufs]
    times = {name: [] for name in forms}
    for _ in range(rounds):
      for name, entry in forms.items():
        step, bufs = entry
        t = time.perf_counter()
        for i in range(steps):
          bufs = step(bufs, rows, length + i)
        jax.block_until_ready(bufs)
        times[name].append((time.perf_counter() - t) / steps * 1e3)
        entry[1] = bufs
    out[f"B{batch}"] = {name: {"ms_per_step": float(np.median(t)), "rounds_ms": t}
                        for name, t in times.items()}
  return out


def server_run(cpus: str | None, model: str, rounds: int) -> dict:
  """4 concurrent 128-token greedy completions against a fresh server (its own cache
  directory: it compiles), per round; tok/s."""
  import openai  # noqa: PLC0415

  port = free_port()
  cache = tempfile.mkdtemp(prefix="ftjax-kv-write-")
  cmd = [sys.executable, "-m", "ftjax.serve", f"--port={port}", "--max_running=4",
         f"--model={model}"]
  if cpus is not None:
    cmd = ["taskset", "-c", cpus] + cmd
  proc = subprocess.Popen(cmd, env=dict(os.environ, FTJAX_CACHE_DIR=cache),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    for _ in range(1200):
      try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        break
      except OSError:
        if proc.poll() is not None:
          raise RuntimeError(f"ftjax.serve exited with {proc.returncode}") from None
        time.sleep(0.5)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")

    def one(i):
      r = client.completions.create(model=model, prompt=f"def f{i}(x):", max_tokens=128,
                                    temperature=0)
      return r.usage.completion_tokens

    rates = []
    for _ in range(rounds + 1):  # the first compiles what the warm-up did not
      t = time.perf_counter()
      with concurrent.futures.ThreadPoolExecutor(4) as pool:
        tokens = sum(pool.map(one, range(4)))
      rates.append(tokens / (time.perf_counter() - t))
    return {"tok_s": float(np.median(rates[1:])), "rounds_tok_s": rates[1:],
            "first_round_tok_s": rates[0]}
  finally:
    proc.terminate()
    proc.wait()


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--server_rounds", type=int, default=3)
  p.add_argument("--model", default="default")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  if args.child:
    print(json.dumps(write_child(args.rounds, args.steps)))
    return
  cpus = sorted(os.sched_getaffinity(0))
  settings = {"1 CPU": str(cpus[-1]), f"{len(cpus)} CPUs": None}
  results = {"write": {}, "server": {}}
  for label, pin in settings.items():
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"--rounds={args.rounds}",
           f"--steps={args.steps}"]
    if pin is not None:
      cmd = ["taskset", "-c", pin] + cmd
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
    child = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    results["write"][label] = json.loads(child.stdout.strip().splitlines()[-1])
    for batch, forms in results["write"][label].items():
      prev, cur = forms["previous"]["ms_per_step"], forms["current"]["ms_per_step"]
      forms["previous_over_current"] = prev / cur
      print(f"{label}, {batch}: {CACHES} KV writes a step, previous {prev:.3f} ms, current "
            f"{cur:.3f} ms: {prev / cur:.1f}x", flush=True)
  for label, pin in settings.items():
    results["server"][label] = server_run(pin, args.model, args.server_rounds)
    print(f"server, {label}: 4 x 128 tokens at {results['server'][label]['tok_s']:.0f} tok/s "
          f"(median of {args.server_rounds})", flush=True)
  results.update(machine=machine_info(), caches=CACHES, cache_shape=[None, S, G, A],
                 model=args.model, rounds=args.rounds, steps=args.steps,
                 previous_server_tok_s_this_session={"1 CPU": [106, 92, 87, 94],
                                                      "2 CPUs": [1833, 2633, 2714, 3184]})
  print("wrote", write_results("kv_write", results, args.out))


if __name__ == "__main__":
  main()
