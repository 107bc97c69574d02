"""A load tool no one here wrote, side by side: NVIDIA's aiperf against ``ftjax.serve
--max_running 4`` and ``llama-server -np 4`` on the same weights (issue 54).

aiperf is installed from the registry into its own virtual environment (``--venv``, made on
first use, with transformers for its tokenizer). Weights: each embedded model, and llama.cpp's
BF16 GGUF of it (``dense_quality.prepare_ggufs``: exported to the Hugging Face layout, checked
by a round trip, converted by llama.cpp's converter; cached). Both servers run at once, each
idle while the other is measured:

- ftjax: ``python -m ftjax.serve --model NAME --max_running 4`` (default kernels and flags);
- llama-server: ``llama-server -m GGUF -t THREADS -c 16384 -np 4 --jinja`` (4 slots,
  continuous batching, the GGUF's chat template).

The client needs a core of its own: on this project's 2-core machines aiperf's timing process
held ~0.9 of a core, and llama-server's thread pool (``-t 2``) stalls when one of its threads
is descheduled (a lone request decoded at 16.5 tok/s beside aiperf, against 345 tok/s per slot
with 4 requests in the warm-up). So the servers run on ``--server_cpus`` (default: every CPU
but the first; ``taskset``; llama-server with ``-t`` as many, ftjax's kernels take the
affinity) and aiperf on ``--client_cpus`` (default: the first).

A run is ``aiperf profile`` with synthetic prompts of ``--isl`` tokens (aiperf's corpus, its
tokenizer the model's) asking for ``--osl`` tokens, streaming, at a concurrency of 1, 4 and 8
with ``4 x concurrency`` requests (at least 8), through ``chat`` and ``completions``; token
counts are the servers' (``--use-server-token-count``). A warm-up pass over every cell comes
first (not counted: each server's programs, batch states and session pool filled), then
rounds (``--rounds``) alternate which server goes first; per cell the medians over rounds of
aiperf's output tok/s, TTFT p50/p99, inter-token latency p50/p99 and errors. ftjax's RSS is
read after the warm-up and 30 s idle (its baseline: the session pool filled, the programs a
warm start loads in the background loaded, the idle engine's heap trim done), after every run,
with what its session pool holds (``ftjax_session_bytes``) and the programs it has prepared
(``ftjax_compiles_total``), and again after 30 s idle: goal, no growth past the baseline beyond
the pool's own.

Run: ``python benchmarks/aiperf_peer.py`` (``--models``, ``--rounds``, ``--isl``, ``--osl``).
Writes ``results/aiperf_peer.{json,png}`` with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, pyplot, write_results  # noqa: E402
from dense_quality import LLAMA_BUILD, LLAMA_SRC, prepare_ggufs  # noqa: E402

AIPERF = "aiperf==0.13.0"  # the version this script was written against
CONCURRENCY = (1, 4, 8)
ENDPOINTS = ("chat", "completions")
SIDES = ("ftjax", "llama")
SETTLE_S = 30  # seconds idle before the last RSS reading


def ensure_aiperf(venv: str) -> str:
  exe = os.path.join(venv, "bin", "aiperf")
  if not os.path.exists(exe):
    print(f"installing {AIPERF} into {venv} (from the package registry)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", AIPERF, "transformers"],
                   check=True)
  return exe


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def wait_healthy(proc, port: int, what: str, log_path: str, seconds: float = 900) -> None:
  deadline = time.time() + seconds
  while time.time() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"{what} exited with {proc.returncode}: see {log_path}")
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        if r.status == 200:
          return
    except OSError:
      pass
    time.sleep(0.5)
  raise RuntimeError(f"{what} did not become healthy: see {log_path}")


def rss_bytes(pid: int) -> int:
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  return 0


def metric(port: int, name: str) -> int:
  """A value on ftjax's ``/metrics`` (0 when absent)."""
  with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
    for line in r.read().decode().splitlines():
      if line.startswith(f"{name} "):
        return int(float(line.split()[1]))
  return 0


def session_bytes(port: int) -> int:
  """What ftjax's session pool holds (``ftjax_session_bytes``): KV, recurrent states and
  anchors of the sessions it keeps for the next turns, within its budget."""
  return metric(port, "ftjax_session_bytes")


def programs(port: int) -> dict:
  """The programs ftjax has prepared so far: compiled or loaded (``ftjax_compiles_total``), of
  them loaded from the executable store (``ftjax_programs_loaded_total``): each new one holds
  its code in RSS."""
  return {"prepared": metric(port, "ftjax_compiles_total"),
          "loaded": metric(port, "ftjax_programs_loaded_total")}


def pinned(cpus: str, cmd: list[str]) -> list[str]:
  return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def run_aiperf(exe: str, port: int, model: str, endpoint: str, concurrency: int, args,
               tokenizer: str, out: str) -> dict:
  shutil.rmtree(out, ignore_errors=True)
  count = max(8, 4 * concurrency)
  cmd = pinned(args.client_cpus, [exe, "profile", "--model", model, "--url", f"http://127.0.0.1:{port}",
         "--endpoint-type", endpoint, "--streaming", "--concurrency", str(concurrency),
         "--request-count", str(count), "--prompt-input-tokens-mean", str(args.isl),
         "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(args.osl),
         "--prompt-output-tokens-stddev", "0", "--tokenizer", tokenizer,
         "--use-server-token-count", "--output-artifact-dir", out, "--ui", "simple",
         "--no-server-metrics", "--no-gpu-telemetry", "--random-seed", "1"])
  with open(out + ".log", "w") as log:
    # (HF_HUB_OFFLINE=1 makes aiperf refuse a tokenizer directory as a repository name.)
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
  path = os.path.join(out, "profile_export_aiperf.json")
  if proc.returncode or not os.path.exists(path):
    raise RuntimeError(f"aiperf failed (exit {proc.returncode}): see {out}.log")
  with open(path) as f:
    d = json.load(f)

  def stat(name, key):
    return (d.get(name) or {}).get(key)

  errors = sum((e.get("count", 0) for e in d.get("error_summary") or []), 0)
  return {"requests": count, "errors": errors,
          "output_tok_s": stat("output_token_throughput", "avg"),
          "request_s": stat("request_throughput", "avg"),
          "ttft_p50_ms": stat("time_to_first_token", "p50"),
          "ttft_p99_ms": stat("time_to_first_token", "p99"),
          "itl_p50_ms": stat("inter_token_latency", "p50"),
          "itl_p99_ms": stat("inter_token_latency", "p99"),
          "osl_mean": stat("output_sequence_length", "avg")}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default="default,default-hybrid")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--isl", type=int, default=256, help="prompt tokens")
  p.add_argument("--osl", type=int, default=128, help="tokens asked for")
  p.add_argument("--venv", default=os.path.join(tempfile.gettempdir(), "ftjax-aiperf-venv"))
  p.add_argument("--llama_build", default=LLAMA_BUILD)
  p.add_argument("--llama_src", default=LLAMA_SRC)
  p.add_argument("--gguf_dir", default=os.path.join(
      os.environ.get("FTJAX_CACHE_DIR") or os.path.expanduser("~/.cache/ftjax"),
      "dense_quality"), help="where dense_quality.py keeps its GGUFs")
  cpus = sorted(os.sched_getaffinity(0))
  p.add_argument("--server_cpus", default=",".join(map(str, cpus[1:] or cpus)),
                 help="CPUs the servers run on (taskset; empty: no pinning)")
  p.add_argument("--client_cpus", default=str(cpus[0]), help="CPUs aiperf runs on")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  threads = len(args.server_cpus.split(",")) if args.server_cpus else 2
  from ftjax.assets import EMBEDDED_MODELS  # noqa: PLC0415
  exe = ensure_aiperf(args.venv)
  work = tempfile.mkdtemp(prefix="ftjax-aiperf-")
  report = {"machine": machine_info(), "aiperf": AIPERF, "isl": args.isl, "osl": args.osl,
            "rounds": args.rounds, "server_cpus": args.server_cpus,
            "client_cpus": args.client_cpus, "llama_threads": threads, "models": {}}
  for name in args.models.split(","):
    ftw_dir = EMBEDDED_MODELS[name]
    gguf = prepare_ggufs(name, ftw_dir, argparse.Namespace(
        work_dir=args.gguf_dir, llama_src=args.llama_src, llama_build=args.llama_build,
        threads=2))["files"]["BF16"]
    tok = os.path.join(work, f"tokenizer-{name}")
    os.makedirs(tok, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
      shutil.copy(os.path.join(ftw_dir, f), tok)
    ports = {"ftjax": free_port(), "llama": free_port()}
    logs = {side: os.path.join(work, f"{side}-{name}.log") for side in SIDES}
    procs = {
        "ftjax": subprocess.Popen(pinned(args.server_cpus, [
            sys.executable, "-m", "ftjax.serve", f"--model={name}", f"--port={ports['ftjax']}",
            "--max_running=4"]), stdout=open(logs["ftjax"], "w"), stderr=subprocess.STDOUT),
        "llama": subprocess.Popen(pinned(args.server_cpus, [
            os.path.join(args.llama_build, "bin", "llama-server"), "-m", gguf, "-t",
            str(threads), "-c", "16384", "-np", "4", "--jinja", "--host", "127.0.0.1",
            "--port", str(ports["llama"])]), stdout=open(logs["llama"], "w"),
            stderr=subprocess.STDOUT)}
    try:
      for side in SIDES:
        wait_healthy(procs[side], ports[side], side, logs[side])
      for endpoint in ENDPOINTS:  # warm-up: one pass over every cell, not counted
        for c in CONCURRENCY:
          for side in SIDES:
            run_aiperf(exe, ports[side], name, endpoint, c, args, tok,
                       os.path.join(work, f"warm-{side}-{name}-{endpoint}-{c}"))
      time.sleep(SETTLE_S)  # idle, as before the last reading
      baseline = rss_bytes(procs["ftjax"].pid)
      trims_baseline = metric(ports["ftjax"], "ftjax_heap_trims")
      pool_baseline = session_bytes(ports["ftjax"])
      programs_baseline = programs(ports["ftjax"])
      rss_after, pool_after, programs_after = [], [], []
      cells: dict[str, list[dict]] = {}
      for r in range(args.rounds):
        for endpoint in ENDPOINTS:
          for c in CONCURRENCY:
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
              row = run_aiperf(exe, ports[side], name, endpoint, c, args, tok,
                               os.path.join(work, f"{side}-{name}-{endpoint}-{c}-{r}"))
              cells.setdefault(f"{side}/{endpoint}/{c}", []).append(row)
              if side == "ftjax":
                rss_after.append(rss_bytes(procs["ftjax"].pid))
                pool_after.append(session_bytes(ports["ftjax"]))
                programs_after.append(programs(ports["ftjax"]))
              print(f"{name} round {r} {side} {endpoint} c={c}: {row['output_tok_s']:.0f} tok/s, "
                    f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms, "
                    f"errors {row['errors']}", flush=True)
      time.sleep(2)
      final = rss_bytes(procs["ftjax"].pid)
      pool_final = session_bytes(ports["ftjax"])
      time.sleep(SETTLE_S)  # idle: what is still held after the last request's work is done
      settled = rss_bytes(procs["ftjax"].pid)
      trims = metric(ports["ftjax"], "ftjax_heap_trims") - trims_baseline
      programs_settled = programs(ports["ftjax"])
    finally:
      for proc in procs.values():
        proc.terminate()
        try:
          proc.wait(60)
        except subprocess.TimeoutExpired:
          proc.kill()
    med = {key: {k: float(np.median([row[k] for row in rows])) for k in rows[0]
                 if isinstance(rows[0][k], (int, float)) and rows[0][k] is not None}
           for key, rows in cells.items()}
    ratios = {f"{e}/{c}": med[f"ftjax/{e}/{c}"]["output_tok_s"] / med[f"llama/{e}/{c}"][
        "output_tok_s"] for e in ENDPOINTS for c in CONCURRENCY}
    report["models"][name] = {
        "gguf": gguf, "cells": cells, "median": med, "throughput_ratio_ftjax_over_llama": ratios,
        "errors": sum(row["errors"] for rows in cells.values() for row in rows),
        "ftjax_rss": {"baseline_bytes": baseline, "after_each_run_bytes": rss_after,
                      "final_bytes": final, "growth_bytes": final - baseline,
                      "session_pool_baseline_bytes": pool_baseline,
                      "session_pool_after_each_run_bytes": pool_after,
                      "session_pool_final_bytes": pool_final,
                      "growth_beyond_the_session_pool_bytes":
                          final - baseline - (pool_final - pool_baseline),
                      f"after_{SETTLE_S}_s_idle_bytes": settled,
                      "growth_after_idle_bytes": settled - baseline,
                      "heap_trims_during_the_runs": trims,
                      "programs_after_idle": programs_settled,
                      "programs_baseline": programs_baseline,
                      "programs_after_each_run": programs_after}}
    print(f"{name}: output tok/s ftjax / llama-server: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
          + f"; ftjax RSS {baseline / 2**20:.0f} -> {final / 2**20:.0f} MiB, "
          f"{settled / 2**20:.0f} MiB after {SETTLE_S} s idle, its session pool "
          f"{pool_baseline / 2**20:.0f} -> {pool_final / 2**20:.0f} MiB", flush=True)
  path = write_results("aiperf_peer", report, args.out)
  plt = pyplot()
  if plt is not None:
    models = list(report["models"])
    fig, axes = plt.subplots(len(models), 3, figsize=(13, 3.6 * len(models)), squeeze=False)
    for i, name in enumerate(models):
      med = report["models"][name]["median"]
      for j, (field, label) in enumerate((("output_tok_s", "output tok/s"),
                                           ("ttft_p50_ms", "TTFT p50 (ms)"),
                                           ("itl_p50_ms", "inter-token latency p50 (ms)"))):
        ax = axes[i][j]
        for side, marker in (("ftjax", "o"), ("llama", "s")):
          for endpoint, style in (("chat", "-"), ("completions", "--")):
            ax.plot(CONCURRENCY, [med[f"{side}/{endpoint}/{c}"][field] for c in CONCURRENCY],
                    style, marker=marker,
                    label=f"{'ftjax.serve' if side == 'ftjax' else 'llama-server'} {endpoint}")
        ax.set_xticks(CONCURRENCY)
        ax.set_xlabel("concurrency")
        ax.set_title(f"{name}: {label}", fontsize=9)
        if i == 0 and j == 0:
          ax.legend(fontsize=7)
    fig.suptitle(f"aiperf ({AIPERF}): ftjax.serve --max_running 4 vs llama-server -np 4, "
                 f"{args.isl} in / {args.osl} out, streaming", fontsize=10)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=110)
  shutil.rmtree(work, ignore_errors=True)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
