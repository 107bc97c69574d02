"""Start-up of ``python -m ftjax.serve`` with its start-up compilation (``--precompile``, on by
default): cold and warm from the persistent compilation cache.

  python benchmarks/serve_startup.py [--rounds=2] [--models=default,default-hybrid,DIR]
      [--bench_model]

For each model, a fresh server process three ways, alternating within each round:

* cold: an empty ``FTJAX_CACHE_DIR`` (every program compiled, then stored);
* warm: the same directory again (every program loaded whole from the executable store,
  untraced: ``ftjax.runtime.compile_cache``);
* traced: the same with ``--noexecutable_store`` (JAX's cache alone: each program traced and
  lowered before the cache answers, as before the store); warm and traced alternate their
  order from round to round;
* lazy: ``--noprecompile`` with the warm cache (ready at once; requests compile as they come);
* beside it (``--llama``, the default where llama-server is built: ../shared/PEERS.md),
  llama-server on the same weights (the embedded models' BF16 GGUF from llama.cpp's converter,
  ``dense_quality.prepare_ggufs``; with ``--bench_model``, also cpu_peer.py's 4-layer
  Qwen3-30B-A3B-shaped model and its BF16 GGUF; ``-t 2 -c 16384 -np 4``): ``llama_warm`` with the GGUF in
  the page cache, and ``llama_cold`` after the page cache is dropped (root only:
  ``/proc/sys/vm/drop_caches``). Each round runs llama_cold, llama_warm, then ftjax's ways: with
  llama-server beside, ftjax's ``cold`` also reads its weights from disk (dropped with the rest
  of the page cache) on top of an empty compilation cache; without it, only the latter.

Reported per way: seconds from the process's start to ``GET /health`` answering 200 (the
interpreter, jax and the model's loading included), the programs compiled at start-up and
their seconds as ``/health`` reports them, and the compiles the first request paid
(``/metrics``). The first request is a 600-token completion of one token. Medians over
rounds; writes ``results/serve_startup.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from common import machine_info, write_results
from cpu_peer import convert_gguf, write_checkpoint
from dense_quality import LLAMA_BUILD, LLAMA_SRC, prepare_ggufs

from ftjax.assets import EMBEDDED_MODELS

LISTEN = re.compile(r"on http://\[?([^\]/]+?)\]?:(\d+)/v1")


def _get(port: int, path: str, body: dict | None = None) -> tuple[int, str]:
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
  if body is None:
    conn.request("GET", path)
  else:
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
  response = conn.getresponse()
  text = response.read().decode()
  conn.close()
  return response.status, text


def _metric(text: str, name: str) -> float:
  return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def _wait_healthy(proc, port: int, t0: float, what: str) -> str:
  """Polls ``GET /health`` until it answers 200 (its body), for at most 900 s from ``t0``."""
  while True:
    if proc.poll() is not None:
      raise RuntimeError(f"{what} exited ({proc.returncode}) before it was ready")
    try:
      status, text = _get(port, "/health")
    except OSError:
      status = None
    if status == 200:
      return text
    if time.perf_counter() - t0 > 900:
      raise RuntimeError(f"{what} was not ready after 900 s")
    time.sleep(0.05)


def _first_request(port: int) -> tuple[float, int]:
  """Seconds and status of a 300-word completion of one token."""
  prompt = " ".join(f"word{i}" for i in range(300))
  t1 = time.perf_counter()
  status, _ = _get(port, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 1,
                                             "temperature": 0})
  return time.perf_counter() - t1, status


def run(model: str, cache_root: str, *flags: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["FTJAX_CACHE_DIR"] = cache_root
  t0 = time.perf_counter()
  proc = subprocess.Popen([sys.executable, "-m", "ftjax.serve", f"--model={model}", "--port=0",
                           *flags], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, env=env)
  try:
    port = None
    while port is None:
      line = proc.stdout.readline()
      if not line:
        raise RuntimeError(f"ftjax.serve exited ({proc.wait()}) before listening")
      found = LISTEN.search(line)
      port = int(found.group(2)) if found else None
    text = _wait_healthy(proc, port, t0, "ftjax.serve")
    ready = time.perf_counter() - t0
    startup = json.loads(text)["startup"]
    before = _metric(_get(port, "/metrics")[1], "ftjax_compiles_total")
    first, status = _first_request(port)
    after = _metric(_get(port, "/metrics")[1], "ftjax_compiles_total")
    return {"ready_s": ready, "startup_programs": startup["compiled"],
            "startup_compile_s": startup["seconds"], "first_request_s": first,
            "first_request_compiles": after - before, "first_request_status": status}
  finally:
    proc.terminate()
    proc.wait(timeout=60)


def drop_page_cache() -> bool:
  try:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
    return True
  except OSError:
    return False


def run_llama(build: str, gguf: str) -> dict:
  """llama-server from the process's start to ``GET /health`` 200, then the same first
  request as ftjax's (a 300-word completion of one token)."""
  port = _free_port()
  t0 = time.perf_counter()
  proc = subprocess.Popen([os.path.join(build, "bin", "llama-server"), "-m", gguf, "-t", "2",
                           "-c", "16384", "-np", "4", "--host", "127.0.0.1", "--port",
                           str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    _wait_healthy(proc, port, t0, "llama-server")
    ready = time.perf_counter() - t0
    first, status = _first_request(port)
    return {"ready_s": ready, "first_request_s": first, "first_request_status": status}
  finally:
    proc.terminate()
    proc.wait(timeout=60)


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--models", default="default,default-hybrid")
  parser.add_argument("--llama", action=argparse.BooleanOptionalAction,
                      default=os.path.exists(os.path.join(LLAMA_BUILD, "bin", "llama-server")),
                      help="llama-server beside (embedded models and --bench_model)")
  parser.add_argument("--llama_build", default=LLAMA_BUILD)
  parser.add_argument("--llama_src", default=LLAMA_SRC)
  parser.add_argument("--gguf_dir", default=os.path.join(
      os.environ.get("FTJAX_CACHE_DIR") or os.path.expanduser("~/.cache/ftjax"),
      "dense_quality"), help="where dense_quality.py keeps its GGUFs")
  parser.add_argument("--bench_model", action="store_true",
                      help="also cpu_peer.py's bench model: 4 layers of Qwen3-30B-A3B's shape, "
                      "random bf16 weights written to --bench_dir (~5 GB; kept for the next "
                      "run), converted once by ftjax before the rounds, beside llama-server "
                      "on llama.cpp's BF16 GGUF of them")
  parser.add_argument("--bench_dir", default="/tmp/ftjax-cpu-peer",
                      help="cpu_peer.py's work directory (its checkpoint and GGUF are reused)")
  parser.add_argument("--out", default=None,
                      help="results file (default results/serve_startup.json)")
  args = parser.parse_args()
  models = [m for m in args.models.split(",") if m]
  ggufs = {}
  if args.bench_model:
    hf_dir = write_checkpoint(4, os.path.join(args.bench_dir, "hf-4l"))
    subprocess.run([sys.executable, "-c", f"import ftjax; ftjax.load({hf_dir!r})"], check=True)
    if args.llama:
      ggufs[hf_dir] = convert_gguf(hf_dir, args.llama_src, args.bench_dir)
    models.append(hf_dir)
  results = {"machine": machine_info(), "command": "python -m ftjax.serve --port=0",
             "llama_command": "llama-server -m BF16.gguf -t 2 -c 16384 -np 4", "models": {}}
  for model in models:
    rows = {"cold": [], "warm": [], "traced": [], "lazy": []}
    gguf = ggufs.get(model)
    if gguf is not None:
      rows.update(llama_warm=[], llama_cold=[])
    elif args.llama and model in EMBEDDED_MODELS:
      gguf = prepare_ggufs(model, EMBEDDED_MODELS[model], argparse.Namespace(
          work_dir=args.gguf_dir, llama_src=args.llama_src, llama_build=args.llama_build,
          threads=2))["files"]["BF16"]
      rows.update(llama_warm=[], llama_cold=[])
    for r in range(args.rounds):
      root = tempfile.mkdtemp(prefix="ftjax-serve-startup-")
      try:
        if gguf is not None:
          dropped = drop_page_cache()
          rows["llama_cold"].append({**run_llama(args.llama_build, gguf),
                                     "page_cache_dropped": dropped})
          rows["llama_warm"].append(run_llama(args.llama_build, gguf))
        rows["cold"].append(run(model, root, "--served_model_name=m"))
        ways = [("warm", ()), ("traced", ("--noexecutable_store",))]
        for way, flags in (ways if r % 2 == 0 else ways[::-1]):
          rows[way].append(run(model, root, "--served_model_name=m", *flags))
        rows["lazy"].append(run(model, root, "--served_model_name=m", "--noprecompile"))
      finally:
        shutil.rmtree(root, ignore_errors=True)
      print(f"{model} round {r + 1}: " + ", ".join(
          f"{way} ready {rows[way][-1]['ready_s']:.1f} s, first request "
          f"{rows[way][-1]['first_request_s']:.2f} s" for way in rows), flush=True)
    summary = {way: {key: statistics.median(row[key] for row in rows[way])
                     for key in rows[way][0]} for way in rows}
    results["models"][model] = {"rounds": rows, "median": summary}
    for way, row in summary.items():
      if way.startswith("llama"):
        print(f"{model:>16} {way:>10}: ready in {row['ready_s']:6.1f} s; first request "
              f"{row['first_request_s']:.2f} s", flush=True)
        continue
      print(f"{model:>16} {way:>10}: ready in {row['ready_s']:6.1f} s "
            f"({row['startup_programs']:.0f} programs at start-up, "
            f"{row['startup_compile_s']:.1f} s); first request {row['first_request_s']:.2f} s "
            f"with {row['first_request_compiles']:.0f} compiles", flush=True)
    if gguf is not None:
      ratios = {f"{way}_over_llama_{peer}": summary[way]["ready_s"] /
                summary[f"llama_{peer}"]["ready_s"]
                for way, peer in (("warm", "warm"), ("cold", "cold"), ("lazy", "warm"))}
      results["models"][model]["ready_ratio"] = ratios
      print(f"{model:>16} ready, ftjax / llama-server: " +
            ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + " (goal: warm <= 2x)",
            flush=True)
  print("wrote", write_results("serve_startup", results, args.out))


if __name__ == "__main__":
  main()
