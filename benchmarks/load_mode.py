"""The weights copied into the process's memory against mapped from their files (``ftjax.load``'s
``load_mode``, ``--load_mode``): load time, the read rate of the expert bank as each holds it,
and decode tok/s (issue 34).

The model is ``cpu_peer.py``'s: Qwen3-30B-A3B's layer shapes at 4 layers, random bfloat16
weights written once as a Hugging Face checkpoint into ``--work_dir`` and converted once into
``$FTJAX_CACHE_DIR`` (6.2 GB of FTW files; nothing committed but the results). Each
measurement is a fresh process (``--worker MODE``), with the files in the page cache (a
discarded warm-up run of each mode reads them first):

- ``mmap``: ``ftjax.load(..., load_mode="mmap", populate=True)``: views of the mapped files,
  every page faulted in first (what ``--load_mode=mmap`` with ``--prefault`` does);
- ``copy``: ``load_mode="copy"``: the files read into the process's own memory.

Per process: the load's seconds; the read rate of ``model.bank`` (``ftjax.kernels.read_probe``,
median of 5) and, as the ceiling of the same moment, of a fresh copy of it in the process's
own memory; decode tok/s of 64 greedy tokens after an 8-token prompt (median of 3 runs, after
one that compiles); and how the kernel maps the pages (``/proc/self/smaps_rollup``:
``FilePmdMapped``, ``AnonHugePages``). Rounds alternate the order of the modes (``--rounds``,
default 3); medians. The read rate of mapped pages varies with where the page cache's pages
sit (on the Xeon VM, 17 GB/s one hour and 25 GB/s the next, against 32 GB/s copied): the
results keep every round.

  /work/venv/bin/python benchmarks/load_mode.py [--rounds 3]

Results: ``benchmarks/results/load_mode.json`` (machine and ISA included).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402

MODES = ("mmap", "copy")
DECODE_TOKENS = 64


def log(msg: str) -> None:
  print(f"[load_mode] {msg}", file=sys.stderr, flush=True)


def read_gb_s(array) -> float:
  import jax  # noqa: PLC0415

  from ftjax.kernels.read_probe import read_probe  # noqa: PLC0415
  read_probe(array).block_until_ready()
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(read_probe(array))
    times.append(time.perf_counter() - t0)
  return array.nbytes / statistics.median(times) / 1e9


def worker(mode: str, hf_dir: str) -> dict:
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  t0 = time.perf_counter()
  model = ftjax.load(hf_dir, verify=False, populate=True, load_mode=mode)
  load_s = time.perf_counter() - t0
  smaps = {m.group(1): int(m.group(2)) * 1024 for m in re.finditer(
      r"^(FilePmdMapped|AnonHugePages):\s+(\d+) kB", open("/proc/self/smaps_rollup").read(),
      re.M)}
  bank_read = read_gb_s(model.bank)
  own = jnp.array(np.array(model.bank))  # a fresh copy in this process's memory
  own_read = read_gb_s(own)
  del own
  engine = ftjax.Engine(model)
  ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 8)
  engine.generate_timed(ids, DECODE_TOKENS + 1)
  decode = statistics.median(engine.generate_timed(ids, DECODE_TOKENS + 1).decode_tok_s
                             for _ in range(3))
  return {"mode": mode, "residency": model.storage.residency, "load_s": load_s,
          "bytes": model.storage.mapped_bytes(), "bank_read_gb_s": bank_read,
          "own_memory_read_gb_s": own_read, "decode_tok_s": decode,
          "file_pmd_mapped": smaps.get("FilePmdMapped"),
          "anon_huge_pages": smaps.get("AnonHugePages"), "kernels": engine.kernels_path}


def run_worker(mode: str, hf_dir: str) -> dict:
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", mode,
                         "--hf_dir", hf_dir], capture_output=True, text=True, check=False,
                        cwd="/tmp")
  lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
  if proc.returncode != 0 or not lines:
    raise RuntimeError(f"the {mode} worker failed: {proc.stderr[-2000:]}")
  return json.loads(lines[-1])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--work_dir", default="/tmp/ftjax-cpu-peer")
  p.add_argument("--out", default=None, help="results file (default results/load_mode.json)")
  p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
  p.add_argument("--hf_dir", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    print(json.dumps(worker(args.worker, args.hf_dir)), flush=True)
    return
  from cpu_peer import write_checkpoint  # noqa: PLC0415
  hf_dir = write_checkpoint(4, os.path.join(args.work_dir, "hf-4l"))
  log("warm-up: one run of each mode (converts once, reads the files into the page cache, "
      "tunes the kernels once)")
  for mode in MODES:
    run_worker(mode, hf_dir)
  rounds = []
  for r in range(args.rounds):
    row = {}
    for mode in (MODES if r % 2 == 0 else MODES[::-1]):
      row[mode] = run_worker(mode, hf_dir)
    log(f"round {r + 1}: " + "; ".join(
        f"{m}: load {x['load_s']:.1f} s, bank read {x['bank_read_gb_s']:.1f} GB/s (own memory "
        f"{x['own_memory_read_gb_s']:.1f}), decode {x['decode_tok_s']:.1f} tok/s"
        for m, x in row.items()))
    rounds.append(row)
  keys = ("load_s", "bank_read_gb_s", "own_memory_read_gb_s", "decode_tok_s")
  medians = {m: {k: statistics.median(r[m][k] for r in rounds) for k in keys} for m in MODES}
  ratio = medians["copy"]["decode_tok_s"] / medians["mmap"]["decode_tok_s"]
  results = {"benchmark": "load_mode", "machine": machine_info(), "model": hf_dir,
             "bytes": rounds[0]["copy"]["bytes"], "kernels": rounds[0]["copy"]["kernels"],
             "medians": medians, "decode_copy_over_mmap": ratio, "rounds": rounds}
  print(f"\n{'':6} {'load s':>7} {'bank read GB/s':>15} {'own memory GB/s':>16} "
        f"{'decode tok/s':>13}")
  for m in MODES:
    x = medians[m]
    print(f"{m:6} {x['load_s']:7.1f} {x['bank_read_gb_s']:15.1f} {x['own_memory_read_gb_s']:16.1f} "
          f"{x['decode_tok_s']:13.1f}")
  print(f"decode, copy / mmap: {ratio:.2f}")
  print(f"wrote {write_results('load_mode', results, args.out)}")


if __name__ == "__main__":
  main()
