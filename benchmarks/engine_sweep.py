"""Many engines in one process (issue 50): a policy x cache-size sweep, before and after.

Each (side, model) runs in its own worker process.

A researcher's sweep: for each (policy, cache size) pair, make an ``ftjax.Engine`` on one
loaded model, ``generate`` 12 tokens and drop it (``del engine; gc.collect()``; never
``engine.close()``, on either side: the plain drop pattern users write). 5 policies
(``POLICIES``) x 8 cache sizes (``FRACTIONS`` of the model's routed experts,
``num_moe_layers * num_experts``, rounded) x ``--repeats`` R, in that loop order (policy,
then size, then repeat). After each configuration the worker prints one JSON line: its
seconds (engine made, generate, dropped, collected), ``engine.compile_count`` (read before
the drop), the process's memory maps (lines of /proc/self/maps), RSS (/proc/self/statm) and
peak RSS (``ru_maxrss``). XLA:CPU maps each compiled executable's code into memory: a
process that keeps every executable it compiled reaches ``vm.max_map_count`` (65530 by
default) and the next compile dies inside LLVM ("Cannot allocate memory") or segfaults. The
driver keeps every line up to a crash and records the exit code and the last lines of stderr.

Models (``--models``): ``default`` and ``default-hybrid`` (the embedded ones, R = ``--repeats``,
default 5: 200 configurations), ``bench``: the 4-layer Qwen3-30B-A3B-shaped model of
``decode_e2e.py`` (random bfloat16 weights, written once into ``--model_dir``, 5.9 GB, and
loaded pre-faulted; R = ``--bench_repeats``, default 1: 40 configurations, each compile takes
longer). ``--policies=all`` sweeps every policy but static_hot (with its own ``--out``).
``--time_limit_s`` stops a sweep from starting new configurations past a limit
(said in the results).

Sides (``--sides``), as in ``decode_e2e.py``: ``baseline`` is ftjax at ``--baseline`` (default
937e35c, the commit before the fix), built once into ``--cache_dir``/baseline-<sha>/site and
imported through PYTHONPATH; ``current`` is the installed ftjax (this checkout's ``src/`` with
``--current_src``). Both sides run the current side's model directories (the embedded ones of
the installed ftjax). ``FTJAX_CACHE_DIR`` is left as the user has it; the persistent XLA
compilation cache is off in the workers (``JAX_COMPILATION_CACHE_DIR`` is dropped from their
environment; plain library use does not turn it on).

Results are kept by side and model: a run replaces the (side, model) entries it ran and keeps
the others, so the baseline measured once stays when the current side is run later.

  /work/venv/bin/python benchmarks/engine_sweep.py --sides=baseline   # ~25 min (+ build, model)
  /work/venv/bin/python benchmarks/engine_sweep.py --sides=current    # after the fix
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
from common import RESULTS_DIR, pyplot, write_results  # noqa: E402

REPO = os.path.dirname(BENCH_DIR)
POLICIES = ("freetoken", "lru_fill", "cpu_only", "freetoken_lrfu", "static_layers")
FRACTIONS = (0, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4)
BANDWIDTHS = (10.0, 30.0)  # (B_P, B_H) GB/s: the freetoken policies need them; all get them
NEW_TOKENS = 12
PROMPT = [17, 42, 7, 256, 1000, 3, 99, 512]  # token ids, < every model's vocab
MODELS = ("default", "default-hybrid", "bench")
SIDES = ("baseline", "current")
STDERR_TAIL = 30  # lines of a worker's stderr kept in the results
PAGE = os.sysconf("SC_PAGE_SIZE")


def cache_sizes(total_experts: int) -> list[int]:
  return [round(f * total_experts) for f in FRACTIONS]


# -- Worker side: one (side, model) sweep, with whichever ftjax its sys.path gives. ------------

def memory_now() -> dict:
  with open("/proc/self/maps") as f:
    maps = sum(1 for _ in f)
  with open("/proc/self/statm") as f:
    rss = int(f.read().split()[1]) * PAGE
  return {"maps": maps, "rss_bytes": rss,
          "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def load_model(args):
  """The model the sweep runs on: a directory from the driver (a view of it when this side's
  ftjax predates some of its config fields), or the bench model."""
  import ftjax  # noqa: PLC0415
  from decode_e2e import default_model_view, load_bench_model  # noqa: PLC0415
  if args.model == "bench":
    return load_bench_model(args.layers, args.model_dir, write=True)
  return ftjax.load(default_model_view(args.model_path))


def prepare_main(args) -> None:
  """Before a sweep, in a process of its own: loads the model (the bench model is written
  here when missing) and makes one engine, so that the C++ kernels' per-machine tuning
  (``kernel_tuning="auto"``, measured once per build and shape under ``$FTJAX_CACHE_DIR``)
  is on disk before the measured worker starts: its seconds and its peak RSS (GBs for the
  tuning) are not the sweep's."""
  import ftjax  # noqa: PLC0415
  t0 = time.perf_counter()
  model = load_model(args)
  t1 = time.perf_counter()
  engine = ftjax.Engine(model)
  print(json.dumps({"load_s": t1 - t0, "engine_s": time.perf_counter() - t1,
                    "kernels_path": getattr(engine, "kernels_path", None)}), flush=True)


def worker_main(args) -> None:
  """Prints one JSON line per configuration on the original stdout (anything else that is
  printed goes to stderr)."""
  import faulthandler  # noqa: PLC0415
  faulthandler.enable()  # a segfault's Python stack goes to stderr
  out = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)

  def emit(row: dict) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()

  import jax  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  t0 = time.perf_counter()
  model = load_model(args)
  c = model.config
  total = c.num_moe_layers * c.num_experts
  sizes = cache_sizes(total)
  repeats = args.repeats
  policies = args.policies.split(",")
  emit({"header": True, "ftjax": os.path.dirname(ftjax.__file__), "jax": jax.__version__,
        "model_path": model.path, "model_type": c.model_type, "num_layers": c.num_layers,
        "num_moe_layers": c.num_moe_layers, "num_experts": c.num_experts,
        "total_experts": total, "cache_sizes": sizes, "policies": policies,
        "repeats": repeats, "configs": len(policies) * len(sizes) * repeats,
        "engine_has_close": hasattr(ftjax.Engine, "close"),
        "jax_compilation_cache_dir": jax.config.jax_compilation_cache_dir,
        "ftjax_cache_dir": os.environ.get("FTJAX_CACHE_DIR"),
        "max_map_count": int(open("/proc/sys/vm/max_map_count").read()),
        "load_s": time.perf_counter() - t0, "after_load": memory_now()})
  if jax.config.jax_compilation_cache_dir:
    raise RuntimeError("the persistent compilation cache is on in the worker "
                       f"({jax.config.jax_compilation_cache_dir}): this sweep measures without")
  t_sweep, index = time.perf_counter(), 0
  for policy in policies:
    for size in sizes:
      for rep in range(repeats):
        if args.time_limit_s and time.perf_counter() - t_sweep > args.time_limit_s:
          emit({"cut": True, "after_s": time.perf_counter() - t_sweep})
          return
        t = time.perf_counter()
        engine = ftjax.Engine(model, cache_slots=size, policy=policy, bandwidths=BANDWIDTHS)
        t_made = time.perf_counter()
        tokens = engine.generate(PROMPT, NEW_TOKENS)
        t_gen = time.perf_counter()
        compiles = engine.compile_count
        compile_s = getattr(engine, "compile_s", None)
        # The plain drop: no engine.close(), even where there is one.
        del engine
        gc.collect()
        seconds = time.perf_counter() - t
        index += 1
        emit({"i": index, "policy": policy, "cache_slots": size, "repeat": rep,
              "seconds": seconds, "engine_s": t_made - t, "generate_s": t_gen - t_made,
              "compiles": compiles, "compile_s": compile_s,
              "tokens": tokens if isinstance(tokens, list) else getattr(tokens, "tokens", None),
              **memory_now()})
  emit({"done": True, "sweep_s": time.perf_counter() - t_sweep})


# -- Driver side. -------------------------------------------------------------------------------

def worker_env(side: str, pythonpath: str | None) -> dict:
  env = dict(os.environ, DECODE_E2E_SIDE=f"{side}")
  env.pop("PYTHONPATH", None)
  # Plain library use: no persistent compilation cache (a user's JAX_COMPILATION_CACHE_DIR
  # would turn it on). FTJAX_CACHE_DIR stays as the user has it.
  for key in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
    env.pop(key, None)
  if pythonpath:
    env["PYTHONPATH"] = pythonpath
  return env


def exit_text(code: int | None) -> str:
  if code is None:
    return "?"
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = f"signal {-code}"
    return f"{name} ({128 - code})"
  return str(code)


def run_sweep(side: str, pythonpath: str | None, model: str, model_path: str | None, args,
              repeats: int, time_limit_s: float) -> dict:
  """One worker (after a preparing process): its header, per-configuration rows, exit code
  and last stderr lines."""
  name = os.path.basename(args.out)[: -len(".json")] if args.out.endswith(".json") else args.out
  log_path = os.path.join(args.cache_dir, f"{name}-{side}-{model}.log")
  cmd = [sys.executable, os.path.abspath(__file__), f"--side={side}",
         f"--model={model}", f"--repeats={repeats}", f"--time_limit_s={time_limit_s}",
         f"--layers={args.layers}", f"--model_dir={args.model_dir}",
         f"--policies={args.policies}"]
  if model_path:
    cmd.append(f"--model_path={model_path}")
  print(f"\n[{side} / {model}] preparing (model written if missing, kernel tuning)", flush=True)
  t0 = time.perf_counter()
  with open(log_path[: -len(".log")] + "-prepare.log", "w") as err:
    done = subprocess.run([*cmd, "--prepare"], env=worker_env(side, pythonpath),
                          cwd=args.cache_dir, stdout=subprocess.PIPE, stderr=err, text=True,
                          check=True)
  prepared = {**json.loads(done.stdout.strip().splitlines()[-1]),
              "wall_s": time.perf_counter() - t0}
  print(f"  prepared in {prepared['wall_s']:.0f} s ({prepared['kernels_path']})", flush=True)
  cmd.append("--worker")
  print(f"[{side} / {model}] worker started (R={repeats}; stderr in {log_path})", flush=True)
  t0 = time.perf_counter()
  tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
  proc = subprocess.Popen(cmd, env=worker_env(side, pythonpath), cwd=args.cache_dir,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          errors="replace")

  def drain():
    with open(log_path, "w") as f:
      for line in proc.stderr:
        f.write(line)
        f.flush()
        tail.append(line.rstrip("\n"))

  reader = threading.Thread(target=drain, daemon=True)
  reader.start()
  header, rows, end = None, [], {}
  for line in proc.stdout:
    try:
      msg = json.loads(line)
    except json.JSONDecodeError:
      continue
    if msg.get("header"):
      header = msg
      m = msg["after_load"]
      print(f"  {msg['total_experts']} experts, cache sizes {msg['cache_sizes']}, "
            f"{msg['configs']} configurations; loaded in {msg['load_s']:.1f} s: "
            f"{m['maps']} maps, RSS {m['rss_bytes'] / 2**20:.0f} MiB", flush=True)
    elif "i" in msg:
      rows.append(msg)
      print(f"  {msg['i']:4d} {msg['policy']:<15} slots {msg['cache_slots']:4d} "
            f"r{msg['repeat']} {msg['seconds']:7.2f} s, {msg['compiles']:3d} compiles, "
            f"{msg['maps']:6d} maps, RSS {msg['rss_bytes'] / 2**20:7.0f} MiB", flush=True)
    else:
      end = msg
  code = proc.wait()
  reader.join(timeout=30)
  wall = time.perf_counter() - t0
  asked = header["configs"] if header else None
  print(f"  [{side} / {model}] {len(rows)}/{asked} configurations, exit {exit_text(code)}, "
        f"{wall:.0f} s", flush=True)
  note = None
  if code == -signal.SIGKILL:
    note = "killed by SIGKILL: the kernel's OOM killer unless someone killed it (dmesg says)"
  errors = error_lines(log_path)
  if code:
    print("  last stderr lines:\n    " + "\n    ".join(list(tail)[-8:]), flush=True)
  for e in errors["distinct"]:
    print(f"  stderr, {e['count']} times: {e['line'][:160]}", flush=True)
  return {"prepare": prepared, "header": header, "rows": rows, "completed": len(rows),
          "asked": asked, "returncode": code, "exit": exit_text(code),
          "cut_by_time_limit": bool(end.get("cut")), "time_limit_s": time_limit_s or None,
          "wall_s": wall, "note": note,
          "stderr_errors": errors, "stderr_tail": list(tail), "stderr_log": log_path}


def error_lines(log_path: str, keep: int = 8) -> dict:
  """The distinct error lines of a worker's stderr (LLVM's "Cannot allocate memory", a Python
  exception, "Fatal Python error"), the first ``keep`` of them with their counts; the
  traceback after a segfault alone would hide them."""
  counts: dict[str, int] = {}
  with open(log_path, errors="replace") as f:
    for line in f:
      if ("error" in line.lower() or "exception" in line.lower()) and "File " not in line:
        text = line.strip()
        text = text.split("] ", 1)[-1] if text[:1] in "EWF" and "] " in text else text
        counts[text] = counts.get(text, 0) + 1
  return {"total": sum(counts.values()),
          "distinct": [{"line": k, "count": v} for k, v in list(counts.items())[:keep]]}


def at(rows: list[dict], n: int, key: str):
  return rows[n - 1][key] if len(rows) >= n else None


def summarize(entry: dict) -> dict:
  rows = entry["rows"]
  secs = [r["seconds"] for r in rows]
  first = [r["seconds"] for r in rows if r["repeat"] == 0]
  s = {"completed": entry["completed"], "asked": entry["asked"], "exit": entry["exit"],
       "returncode": entry["returncode"], "cut_by_time_limit": entry["cut_by_time_limit"],
       "median_s": statistics.median(secs) if secs else None,
       "median_s_first_repeat": statistics.median(first) if first else None,
       "total_s": sum(secs), "compiles": sum(r["compiles"] for r in rows),
       "peak_maps": max((r["maps"] for r in rows), default=None),
       "peak_rss_bytes": max((r["peak_rss_bytes"] for r in rows), default=None)}
  for key in ("maps", "rss_bytes"):
    tenth, last = at(rows, 10, key), rows[-1][key] if rows else None
    s[f"{key}_10"], s[f"{key}_last"] = tenth, last
    s[f"{key}_last_over_10"] = last / tenth if tenth and last is not None else None
  return s


def print_table(results: dict) -> None:
  head = (f"{'side':<9}{'model':<15}{'done':>9} {'exit':>12}{'med s':>7}{'med s r0':>9}"
          f"{'total s':>8}{'compiles':>9}{'maps@10':>8}{'maps@end':>9}{'x':>6}{'peak maps':>10}"
          f"{'RSS@10':>8}{'RSS@end':>8}{'x':>6}{'peak RSS':>9}")
  print("\n" + head + "\n" + "-" * len(head))

  def num(v, fmt):
    return "-" if v is None else format(v, fmt)

  def mib(v):
    return "-" if v is None else f"{v / 2**20:.0f}M"

  for side in SIDES:
    for model, entry in results.get("sweeps", {}).get(side, {}).items():
      s = entry["summary"]
      done = f"{s['completed']}/{s['asked']}" + ("*" if s["cut_by_time_limit"] else "")
      print(f"{side:<9}{model:<15}{done:>9} {s['exit']:>12}{num(s['median_s'], '.2f'):>7}"
            f"{num(s['median_s_first_repeat'], '.2f'):>9}{num(s['total_s'], '.0f'):>8}"
            f"{s['compiles']:>9}{num(s['maps_10'], 'd'):>8}{num(s['maps_last'], 'd'):>9}"
            f"{num(s['maps_last_over_10'], '.2f'):>6}{num(s['peak_maps'], 'd'):>10}"
            f"{mib(s['rss_bytes_10']):>8}{mib(s['rss_bytes_last']):>8}"
            f"{num(s['rss_bytes_last_over_10'], '.2f'):>6}{mib(s['peak_rss_bytes']):>9}")
  print("med s: median seconds per configuration; med s r0: over the first repeats only (the "
        "others found their programs still compiled in the process); x: after the last "
        "configuration / after the 10th; * cut by --time_limit_s")


def plot(results: dict, path: str) -> None:
  plt = pyplot()
  if plt is None:
    return
  fig, (ax_maps, ax_rss) = plt.subplots(1, 2, figsize=(13, 5))
  colors = {"default": "tab:blue", "default-hybrid": "tab:orange", "bench": "tab:green"}
  limit = None
  for side in SIDES:
    for model, entry in results.get("sweeps", {}).get(side, {}).items():
      rows = entry["rows"]
      if not rows:
        continue
      limit = limit or (entry.get("header") or {}).get("max_map_count")
      x = [r["i"] for r in rows]
      style = dict(color=colors.get(model, None), linestyle="-" if side == "baseline" else "--",
                   label=f"{side} / {model} ({entry['summary']['exit']})")
      ax_maps.plot(x, [r["maps"] for r in rows], **style)
      base = ((entry.get("header") or {}).get("after_load") or {}).get("rss_bytes", 0)
      ax_rss.plot(x, [(r["rss_bytes"] - base) / 2**30 for r in rows], **style)
      if entry["returncode"]:  # where the worker died
        ax_maps.plot(x[-1], rows[-1]["maps"], "x", color=style["color"], markersize=10)
        ax_rss.plot(x[-1], (rows[-1]["rss_bytes"] - base) / 2**30, "x", color=style["color"],
                    markersize=10)
  if limit:
    ax_maps.axhline(limit, color="gray", linestyle=":", label=f"vm.max_map_count {limit}")
  ax_maps.set(xlabel="configurations done", ylabel="memory maps (/proc/self/maps lines)",
              title="memory maps after each configuration")
  ax_rss.set(xlabel="configurations done", ylabel="RSS - RSS after the model's load (GiB)",
             title="RSS growth after each configuration")
  ax_maps.legend(fontsize=7)
  ax_rss.legend(fontsize=7)
  fig.suptitle("Engine sweep: make an engine, generate 12 tokens, drop it (x: the worker died)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  print(f"wrote {path}")


def parse_limits(text: str) -> dict[str, float]:
  out = {}
  for part in filter(None, text.split(",")):
    model, _, seconds = part.partition("=")
    out[model] = float(seconds)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sides", default="baseline,current")
  parser.add_argument("--baseline", default="937e35c", help="git rev of the 'baseline' side")
  parser.add_argument("--current_src", action="store_true",
                      help="the current side imports this checkout's src/ instead of the "
                      "installed ftjax")
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--policies", default=",".join(POLICIES),
                      help="cache policies swept; 'all': every name in ftjax.cache.POLICIES "
                      "but static_hot (it needs a routing profile); use another --out with "
                      "it: the results of one file share one policy list")
  parser.add_argument("--repeats", type=int, default=5, help="R of the embedded models")
  parser.add_argument("--bench_repeats", type=int, default=1, help="R of the bench model")
  parser.add_argument("--time_limit_s", default="",
                      help="MODEL=SECONDS,...: a sweep starts no configuration past it")
  parser.add_argument("--cache_dir", default="/tmp/ftjax-bench",
                      help="baseline builds (baseline-<sha>/site) and the workers' logs")
  parser.add_argument("--layers", type=int, default=4, help="layers of the bench model")
  parser.add_argument("--model_dir", default="/tmp/ftjax-bench/qwen3-30b-a3b-shape")
  parser.add_argument("--out", default="engine_sweep",
                      help="results name (results/NAME.json, .png) or a path ending in .json")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--side", help=argparse.SUPPRESS)
  parser.add_argument("--model", help=argparse.SUPPRESS)
  parser.add_argument("--model_path", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.prepare:
    prepare_main(args)
    return
  if args.worker:
    args.time_limit_s = float(args.time_limit_s or 0)
    worker_main(args)
    return

  from common import machine_info  # noqa: PLC0415
  from decode_e2e import build_baseline, differing_files  # noqa: PLC0415

  from ftjax.assets import EMBEDDED_MODELS  # noqa: PLC0415 (the current side's models)
  sides = [s for s in args.sides.split(",") if s]
  models = [m for m in args.models.split(",") if m]
  bad = [s for s in sides if s not in SIDES] + [m for m in models if m not in MODELS]
  if bad:
    parser.error(f"unknown sides or models {bad}; sides {SIDES}, models {MODELS}")
  limits = parse_limits(args.time_limit_s)
  if args.policies == "all":
    from ftjax.cache import POLICIES as ALL_POLICIES  # noqa: PLC0415
    args.policies = ",".join(p for p in ALL_POLICIES if p != "static_hot")
  out_path = (args.out if args.out.endswith(".json")
              else os.path.join(RESULTS_DIR, f"{args.out}.json"))
  t_start = time.perf_counter()
  os.makedirs(args.cache_dir, exist_ok=True)

  results = {}
  if os.path.isfile(out_path):
    with open(out_path) as f:
      results = json.load(f)
  results.setdefault("sweeps", {})
  results.setdefault("sides", {})
  results.update({
      "description": "per (side, model): engines made, 12 tokens generated and dropped (del; "
                     "gc.collect(); no close()) over policies x cache sizes x repeats, in one "
                     "worker process",
      "policies": args.policies.split(","), "cache_size_fractions": list(FRACTIONS),
      "bandwidths": list(BANDWIDTHS), "new_tokens": NEW_TOKENS, "prompt_ids": PROMPT})
  machine = machine_info()

  import ftjax  # noqa: PLC0415
  for side in sides:
    pythonpath, rev = None, {}
    if side == "baseline":
      sha, pythonpath = build_baseline(args.baseline, args.cache_dir)
      rev = {"rev": args.baseline, "sha": sha, "site": pythonpath}
    else:
      if args.current_src:
        pythonpath = os.path.join(REPO, "src")
      installed = os.path.dirname(ftjax.__file__)
      stale = [] if args.current_src else differing_files(installed,
                                                          os.path.join(REPO, "src", "ftjax"))
      if stale:
        print(f"WARNING: the installed ftjax ({installed}) differs from this checkout's "
              f"src/ftjax in {len(stale)} files ({', '.join(stale[:4])}...): reinstall it or "
              "pass --current_src", flush=True)
      rev = {"ftjax": pythonpath or installed, "current_src": args.current_src,
             "current_differs_from_checkout": stale}
    results["sides"][side] = {**rev, "machine": machine,
                              "date": machine["date"], "args": vars(args)}
    for model in models:
      repeats = args.bench_repeats if model == "bench" else args.repeats
      entry = run_sweep(side, pythonpath, model, EMBEDDED_MODELS.get(model), args, repeats,
                        limits.get(model, 0.0))
      entry["summary"] = summarize(entry)
      entry["date"] = machine["date"]
      results["sweeps"].setdefault(side, {})[model] = entry
      write_results(args.out, results, out_path)  # after each sweep: a later crash keeps it

  results["machine"] = machine
  results["runtime_s_last_run"] = time.perf_counter() - t_start
  print_table(results)
  out = write_results(args.out, results, out_path)
  print(f"wrote {out} ({results['runtime_s_last_run']:.0f} s in all)")
  plot(results, out_path[: -len(".json")] + ".png")


if __name__ == "__main__":
  main()
