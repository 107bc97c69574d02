"""Shared by the benchmarks: machine description and results files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess

import numpy as np

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine_info() -> dict:
  import jax  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  import ftjax.kernels  # noqa: PLC0415

  def first(path, key):
    with open(path) as f:
      for line in f:
        if line.startswith(key):
          return line.split(":", 1)[1].strip()
    return None

  return {
      "hostname": socket.gethostname(),
      "nproc": int(subprocess.run(["nproc"], capture_output=True, text=True).stdout),
      "mem_total_bytes": int(first("/proc/meminfo", "MemTotal").split()[0]) * 1024,
      "cpu_model": first("/proc/cpuinfo", "model name"),
      "cpu_family": first("/proc/cpuinfo", "cpu family"),  # with the model number: the
      "cpu_model_number": first("/proc/cpuinfo", "model\t"),  # microarchitecture (Zen 3/4/5)
      "isa_flags": [f for f in (first("/proc/cpuinfo", "flags") or "").split()
                    if f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                             "avx512_bf16", "avx512_vnni")],
      "kernel": platform.release(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "ftjax": f"{ftjax.__version__} at {os.path.dirname(ftjax.__file__)}",
      "numpy": np.__version__,
      "ftjax_kernels": _kernels_info(ftjax.kernels),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }


def _kernels_info(kernels) -> dict | str:
  """The ISA, threads and pool the host kernels run with, or why they cannot run."""
  try:
    return kernels.cpu_info()
  except (ImportError, RuntimeError) as e:
    return f"unavailable: {e}"


def write_results(name: str, results: dict, path: str | None = None) -> str:
  """Writes ``results`` to ``path``, by default ``results/NAME.json``; returns the path."""
  path = path or os.path.join(RESULTS_DIR, f"{name}.json")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(results, f, indent=1)
  return path


def pyplot():
  """matplotlib's pyplot on the Agg backend, or None (said on stdout) when matplotlib is not
  installed: the benchmark then writes its numbers without the plot."""
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    print("matplotlib is not installed: no plot", flush=True)
    return None
  return plt


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now (for a server a benchmark starts)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
