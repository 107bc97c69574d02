"""A full-size gpt-oss-20b-shaped model on the CPU, end to end, side by side with llama.cpp
(issue 34, part 3): conversion, load to the first token (cold and warm), decode, 512-token
prefill and peak memory, at the depth real models have.

The checkpoint is ``mxfp4_peer.py``'s at 24 layers: gpt-oss-20b's shapes (32 experts, top-4,
vocabulary 201,088), random weights written the way OpenAI ships them (bfloat16 dense tensors,
MXFP4 expert ``*_blocks`` / ``*_scales``), about 13 GB. Each side converts it with its own
converter, timed with its peak RSS (``/usr/bin/time``), the checkpoint read into the page
cache first:

  ftjax      ``python -m ftjax.convert`` (an FTW with an mxfp4 bank, dense bfloat16)
  llama.cpp  ``convert_hf_to_gguf.py --outtype bf16`` (MXFP4 experts repacked as block_mxfp4)

Load to the first token: each side's server started fresh, seconds from the process's start
to the end of a 1-token completion of a short prompt: ``python -m ftjax.serve`` (its start-up
compiles come from the persistent compilation cache, warmed by an earlier start; the weights
held as its default ``--load_mode=auto`` holds them: copied into its memory where they fit)
and ``llama-server`` (2 threads). Cold: the page cache dropped first (``echo 3 >
/proc/sys/vm/drop_caches``, as root; recorded as not measured otherwise); warm: right after,
the files cached. The server's peak RSS (VmHWM) is read before it stops.

Decode (64 tokens after a short prompt) and 512-token prefill, in alternating rounds: ftjax in a
worker process (loads once, pre-faults its mapping before each round, as the other benchmarks'
workers do), llama.cpp with ``llama-bench -t 2 -r 1 -lm none``. Each round also measures the
read bandwidth (``read_probe`` over one layer's experts) for the roofline of each side's decode.
The files do not fit the 24 GB together: before each side's load timing the other files leave
the page cache (``posix_fadvise(DONTNEED)``), and so does the GGUF before each ftjax round
(otherwise llama.cpp's twice-read file stays on the kernel's active list and the worker's
pages, touched once by its pre-fault, are reclaimed first: decode then reads from disk).
ftjax decodes twice a round: with its default kernels (exact: float32 activations) and with the
opt-in ``kernels="ffi_int8"`` (``decode_int8``: the MXFP4 experts' activations quantised per
block of 32, as llama.cpp's Q8_0 does for its MXFP4 dot product; the same arithmetic as the
peer). Both are reported; the goal is checked on each.

  python benchmarks/full_size.py --llama_src SRC --llama_build BUILD [--rounds 3]

Results: ``benchmarks/results/full_size.json``. Needs ~40 GB of disk in ``--work_dir`` and
``--hf_dir`` (checkpoint, FTW, GGUF: 13 GB each) and ~16 GB of memory.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_peer import free_port  # noqa: E402
from common import machine_info, write_results  # noqa: E402
from cpu_peer import (RoundWorker, check_llama_args, gguf_converter, llama_bench,  # noqa: E402
                      read_gb_s, serve_rounds)
from hybrid_e2e import contended, with_other_load  # noqa: E402
from mxfp4_peer import write_checkpoint  # noqa: E402
from quant_peer import ftjax_bytes_per_token, gguf_bytes_per_token  # noqa: E402

LAYERS = 24
THREADS = 2
DECODE_TOKENS = 64
PREFILL_TOKENS = 512
GOALS = {"decode": 1.0, "prefill_512": 1.2}  # x llama.cpp; warm load: no slower
LISTEN = re.compile(r"on http://\[?([^\]/]+?)\]?:(\d+)/v1")


def log(msg: str) -> None:
  print(f"[full_size] {msg}", file=sys.stderr, flush=True)


def timed(cmd: list[str], **kwargs) -> dict:
  """Runs ``cmd`` under /usr/bin/time: wall seconds and peak RSS."""
  with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
    subprocess.run(["/usr/bin/time", "-o", out.name, "-f", "%e %M", *cmd], check=True,
                   stdout=subprocess.DEVNULL, **kwargs)
    wall, kib = out.read().split()[-2:]
  return {"seconds": float(wall), "peak_rss_bytes": int(kib) * 1024}


def read_into_page_cache(directory: str) -> None:
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      read_into_page_cache_file(path)


def read_into_page_cache_file(path: str) -> None:
  subprocess.run(["cat", path], check=True, stdout=subprocess.DEVNULL)


def evict_from_page_cache(path: str) -> None:
  """Drops a file's pages from the page cache (``posix_fadvise(DONTNEED)``; pages a process
  maps stay). The two 13.8 GB files do not fit the 24 GB together, and a file read twice sits
  on the kernel's active list: the other side's pages, touched once, would go first."""
  paths = ([os.path.join(path, n) for n in sorted(os.listdir(path))] if os.path.isdir(path)
           else [path])
  for p in paths:
    if os.path.isfile(p):
      fd = os.open(p, os.O_RDONLY)
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def drop_caches() -> bool:
  """Drops the page cache (root only); False where it cannot."""
  os.sync()
  try:
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
    return True
  except OSError:
    return False


def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 900):
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
  try:
    conn.request(method, path, None if body is None else json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read().decode()
  finally:
    conn.close()


def vm_hwm(pid: int) -> int:
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  return 0


class ServerExited(RuntimeError):
  def __init__(self, side: str, returncode: int, stderr: str):
    super().__init__(f"{side} server exited ({returncode}): {stderr[-2000:]}")
    self.returncode = returncode


def first_token(side: str, model: str, llama_build: str, extra: tuple[str, ...] = ()) -> dict:
  """A fresh server of ``side`` (``extra``: more flags): seconds from its start to the end of
  a 1-token completion, and its peak RSS."""
  port = free_port()
  if side == "ftjax":
    cmd = [sys.executable, "-m", "ftjax.serve", f"--model={model}", f"--port={port}",
           "--max_seq_len=4096", *extra]
    path = "/v1/completions"
    body = {"model": os.path.basename(model), "prompt": "Hello there", "max_tokens": 1,
            "temperature": 0}
  else:
    cmd = [os.path.join(llama_build, "bin", "llama-server"), "-m", model, "-t", str(THREADS),
           "-c", "4096", "-np", "1", "--host", "127.0.0.1", "--port", str(port), *extra]
    path, body = "/completion", {"prompt": "Hello there", "n_predict": 1, "temperature": 0}
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          cwd="/tmp")
  try:
    while True:
      if proc.poll() is not None:
        raise ServerExited(side, proc.returncode, proc.stderr.read())
      try:
        status, _ = request(port, "GET", "/health", timeout=5)
      except OSError:
        status = None
      if status == 200:
        break
      if time.perf_counter() - t0 > 1800:
        raise RuntimeError(f"{side} server not ready after 1800 s")
      time.sleep(0.05)
    ready = time.perf_counter() - t0
    status, text = request(port, "POST", path, body)
    if status != 200:
      raise RuntimeError(f"{side}: {status} {text[:500]}")
    return {"ready_s": ready, "first_token_s": time.perf_counter() - t0,
            "peak_rss_bytes": vm_hwm(proc.pid)}
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


# -- ftjax side (a worker process) ----------------------------------------------------------------

def worker(ftw_dir: str) -> None:
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  # Mapped, not copied (the default when the files fit): llama-bench reads its 13 GB into its own
  # memory while this worker holds the model, and two private copies do not fit in 24 GB.
  model = ftjax.load(ftw_dir, verify=False, populate=True, load_mode="mmap")
  engine = ftjax.Engine(model, max_seq_len=4096)
  engine_int8 = ftjax.Engine(model, max_seq_len=4096, kernels="ffi_int8")
  rng = np.random.default_rng(0)
  short = rng.integers(0, model.config.vocab_size, 8)
  long = rng.integers(0, model.config.vocab_size, PREFILL_TOKENS)
  experts = model.bank[0]

  def measure() -> dict:
    model.storage.populate()  # llama.cpp's run pushed the mapping out of the page cache
    read = read_gb_s(experts)
    dec = engine.generate_timed(short, DECODE_TOKENS + 1)
    dec_int8 = engine_int8.generate_timed(short, DECODE_TOKENS + 1)
    pre = engine.generate_timed(long, 1)
    return {"decode": dec.decode_tok_s, "decode_int8": dec_int8.decode_tok_s,
            "prefill_512": pre.prefill_tok_s, "read_GBps": read}

  serve_rounds(measure, {"kernels": engine.kernels_path, "kernels_int8": engine_int8.kernels_path,
                         "bytes_per_token": ftjax_bytes_per_token(model)})


# -- Driver ---------------------------------------------------------------------------------------

def convert(hf_dir: str, work_dir: str, llama_src: str) -> tuple[str, str, dict]:
  """Both conversions, timed (the checkpoint in the page cache before each)."""
  ftw = os.path.join(work_dir, "ftw-mxfp4")
  gguf = os.path.join(work_dir, "model-mxfp4.gguf")
  out = {}
  read_into_page_cache(hf_dir)
  log(f"converting with ftjax.convert -> {ftw}")
  out["ftjax"] = timed([sys.executable, "-m", "ftjax.convert", f"--hf_dir={hf_dir}",
                        f"--out={ftw}", "--overwrite"], cwd="/tmp")
  log(f"  {out['ftjax']}")
  script, env, cwd = gguf_converter(llama_src, work_dir)
  read_into_page_cache(hf_dir)
  log(f"converting with llama.cpp's convert_hf_to_gguf.py -> {gguf}")
  out["llama_cpp"] = timed([sys.executable, script, hf_dir, "--outtype", "bf16", "--outfile",
                            gguf], env=env, cwd=cwd)
  log(f"  {out['llama_cpp']}")
  return ftw, gguf, out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--llama_src", help="llama.cpp source tree (vendor/llama.cpp of the sdist)")
  p.add_argument("--llama_build", help="llama.cpp CMake build dir with bin/llama-bench")
  p.add_argument("--hf_dir", default="/tmp/ftjax-full-size/hf")
  p.add_argument("--work_dir", default="/tmp/ftjax-full-size/work")
  p.add_argument("--layers", type=int, default=LAYERS)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--out", default=None)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--ftw_dir", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    worker(args.ftw_dir)
    return
  check_llama_args(p, args)
  machine = machine_info()
  log(f"machine: {machine['cpu_model']} (family {machine['cpu_family']} model "
      f"{machine['cpu_model_number']}), kernels {machine['ftjax_kernels']}")
  os.makedirs(args.work_dir, exist_ok=True)
  t0 = time.perf_counter()
  hf_dir = write_checkpoint(args.layers, None, args.hf_dir)
  log(f"checkpoint ready in {time.perf_counter() - t0:.0f} s")
  ftw, gguf, conversions = convert(hf_dir, args.work_dir, args.llama_src)
  sizes = {"hf": sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir)),
           "ftw": sum(os.path.getsize(os.path.join(ftw, f)) for f in os.listdir(ftw)),
           "gguf": os.path.getsize(gguf)}
  log(f"sizes: {sizes}")

  # Load to the first token. A first ftjax start fills the compilation cache (and the kernel
  # tuning): not timed.
  first_token("ftjax", ftw, args.llama_build)
  loads = {}
  for side, model in (("ftjax", ftw), ("llama_cpp", gguf)):
    for other in (ftw, gguf, hf_dir):
      if other != model:
        evict_from_page_cache(other)
    cold_ok = drop_caches()
    cold = first_token(side, model, args.llama_build) if cold_ok else None
    warm = first_token(side, model, args.llama_build)
    loads[side] = {"cold": cold, "warm": warm}
    log(f"{side}: first token cold {cold and round(cold['first_token_s'], 1)} s, warm "
        f"{warm['first_token_s']:.1f} s, peak RSS {warm['peak_rss_bytes'] / 2**30:.2f} GiB")

  top_k = json.load(open(os.path.join(hf_dir, "config.json")))["num_experts_per_tok"]
  llama_bytes = gguf_bytes_per_token(gguf, args.llama_src, top_k)
  ftjax_worker = RoundWorker(__file__, "--ftw_dir", ftw)
  ready, proc = ftjax_worker.ready, ftjax_worker.proc
  log(f"ftjax worker ready: {ready}")
  rounds = []
  for r in range(args.rounds):
    row = {}
    for side in (("ftjax", "llama_cpp") if r % 2 == 0 else ("llama_cpp", "ftjax")):
      if side == "ftjax":
        evict_from_page_cache(gguf)  # then the worker's populate() keeps its own pages
        row["ftjax"] = with_other_load(ftjax_worker.ask, proc.pid)
      else:
        read_into_page_cache_file(gguf)  # as the ftjax worker's populate(): ftjax's round
        row["llama_cpp"] = with_other_load(lambda: {
            "decode": llama_bench(args.llama_build, gguf, "-p", "0", "-n",
                                  str(DECODE_TOKENS))["avg_ts"],
            "prefill_512": llama_bench(args.llama_build, gguf, "-p", str(PREFILL_TOKENS), "-n",
                                       "0")["avg_ts"]}, proc.pid)
    read = row["ftjax"]["read_GBps"]
    row["ratio"] = {k: row["ftjax"][k] / row["llama_cpp"][k] for k in GOALS}
    row["ratio"]["decode_int8"] = row["ftjax"]["decode_int8"] / row["llama_cpp"]["decode"]
    row["roofline"] = {"ftjax": row["ftjax"]["decode"] * ready["bytes_per_token"] / 1e9 / read,
                       "ftjax_int8": (row["ftjax"]["decode_int8"] * ready["bytes_per_token"]
                                      / 1e9 / read),
                       "llama_cpp": row["llama_cpp"]["decode"] * llama_bytes / 1e9 / read}
    rounds.append(row)
    log(f"round {r + 1}/{args.rounds}: read {read:.1f} GB/s, " + ", ".join(
        f"{k} {row['ftjax'][k]:.1f} vs {row['llama_cpp'][k]:.1f} tok/s ({row['ratio'][k]:.2f}x)"
        for k in GOALS) + f", decode_int8 {row['ftjax']['decode_int8']:.1f} tok/s "
        f"({row['ratio']['decode_int8']:.2f}x); decode roofline ftjax "
        f"{row['roofline']['ftjax']:.2f} (int8 {row['roofline']['ftjax_int8']:.2f}), llama.cpp "
        f"{row['roofline']['llama_cpp']:.2f}" + contended(row["ftjax"])
        + contended(row["llama_cpp"]))
  ftjax_worker.close()
  med = {side: {k: statistics.median(r[side][k] for r in rounds) for k in GOALS}
         for side in ("ftjax", "llama_cpp")}
  med["ftjax"]["decode_int8"] = statistics.median(r["ftjax"]["decode_int8"] for r in rounds)
  ratios = {k: statistics.median(r["ratio"][k] for r in rounds) for k in (*GOALS, "decode_int8")}
  warm_ratio = loads["ftjax"]["warm"]["first_token_s"] / loads["llama_cpp"]["warm"]["first_token_s"]
  results = {
      "benchmark": "full_size", "command": " ".join(sys.argv), "machine": machine,
      "model": {"shape": "gpt-oss-20b", "layers": args.layers, "experts": "MXFP4 as shipped",
                "bytes": sizes},
      "conversion": conversions, "load_to_first_token": loads,
      "ftjax": {"kernels": ready["kernels"], "kernels_int8": ready["kernels_int8"],
                "bytes_per_token": ready["bytes_per_token"]},
      "llama_cpp": {"build": args.llama_build, "bytes_per_token": llama_bytes,
                    "flags": f"-t {THREADS} -r 1 -lm none"},
      "rounds": rounds, "medians": med, "ratio_medians": ratios,
      "roofline_medians": {k: statistics.median(r["roofline"][k] for r in rounds)
                           for k in ("ftjax", "ftjax_int8", "llama_cpp")},
      "warm_load_ratio": warm_ratio,
      "goals": {**GOALS, "warm_load_ratio_at_most": 1.0},
      "goals_met": {**{k: ratios[k] >= g for k, g in GOALS.items()},
                    "decode_int8": ratios["decode_int8"] >= GOALS["decode"],
                    "warm_load": warm_ratio <= 1.0},
  }
  for k, g in (*GOALS.items(), ("decode_int8", GOALS["decode"])):
    peer = med["llama_cpp"]["decode" if k == "decode_int8" else k]
    print(f"{k:12s} ftjax {med['ftjax'][k]:8.2f}  llama.cpp {peer:8.2f} tok/s  "
          f"ratio {ratios[k]:.2f} (goal {g})")
  print(f"warm load to the first token: ftjax {loads['ftjax']['warm']['first_token_s']:.1f} s, "
        f"llama.cpp {loads['llama_cpp']['warm']['first_token_s']:.1f} s ({warm_ratio:.2f}x)")
  print(f"conversion: {conversions}")
  print(f"results: {write_results('full_size', results, args.out)}")


if __name__ == "__main__":
  main()
