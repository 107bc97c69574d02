"""End-to-end decode and prefill, before and after a change, measured in the same run.

Two sides run the same measurements in their own worker processes, in alternating rounds:

- ``baseline``: ftjax at the git rev ``--baseline`` (default a174ea7, the per-token Python
  decode loop), checked out in a temporary worktree, built once into
  ``<cache_dir>/baseline-<sha>/site`` (reused while present) and imported from there;
- ``current``: the installed ftjax, or this checkout's ``src/`` with ``--current_src``.

Each worker loads two models once, compiles (a discarded warm-up round) and then measures
one round per request:

- the current side's embedded default model (``kernels="auto"``; the baseline runs the same
  weights, through a view without the config fields it predates): greedy decode of
  ``--default_tokens`` new tokens after "def fibonacci(n):", ``--default_repeats`` times
  (median within the round);
- a ``--layers``-layer model with Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 KV
  heads, head_dim 128, 128 experts, top-8, expert width 768, vocab 151936, bfloat16; random
  weights written by the current side into ``--model_dir`` once, 5.9 GB at 4 layers, never
  committed), ``kernels=ffi_bf16``: the host read bandwidth (``ftjax.kernels.read_probe``
  over one layer's experts, 1.2 GB), a greedy decode of ``--decode_tokens`` + 1 new tokens
  from an 8-token prompt and a ``--prefill_tokens``-token prefill.

A decoded token reads every dense weight but the embedding plus ``top_k`` experts per layer;
bytes per token / the read bandwidth of the same round is the roofline step time. Per-token
overhead = measured step time (decode seconds / decoded steps) - roofline step time.

Goals (the issue): default-model decode >= 5x the baseline's; on the 30B-shaped model a
per-token overhead <= 0.3 ms and decode >= 0.9 of the roofline. Medians over ``--rounds``.

  /work/venv/bin/python benchmarks/decode_e2e.py                  # ~6 min the first time
  /work/venv/bin/python benchmarks/decode_e2e.py --current_src    # the checkout's src/
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_results  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PROMPT = "def fibonacci(n):"
GOAL_DEFAULT_SPEEDUP = 5.0  # default-model decode tok/s, current / baseline
GOAL_OVERHEAD_MS = 0.3  # 30B-shaped model: step time - bytes per token / read bandwidth
GOAL_ROOFLINE = 0.9  # 30B-shaped model: decode tok/s / roofline tok/s
SIDES = ("baseline", "current")


# -- Worker side: runs in a subprocess, with whichever ftjax its sys.path gives. ---------------

def qwen3_30b_shape(layers: int):
  from ftjax.model.config import ModelConfig  # noqa: PLC0415
  return ModelConfig(
      model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=layers,
      num_heads=32, num_kv_heads=4, head_dim=128, num_experts=128, top_k=8,
      moe_intermediate_size=768, rms_norm_eps=1e-6, rope_theta=1e6,
      max_position_embeddings=40960, layer_types=("full_attention",) * layers,
      qk_norm="per_head", norm_topk_prob=True, source_dtype="bfloat16")


def write_model(config, out_dir: str, seed: int = 0) -> str:
  """Random bfloat16 weights, written tensor by tensor (slices of one random pool)."""
  import ml_dtypes  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from ftjax.formats import ftw  # noqa: PLC0415
  from ftjax.model import abstract_params  # noqa: PLC0415
  from ftjax.utils.progress import Progress  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  pool = (rng.standard_normal(1 << 24, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
  norms = (1.0 + 0.1 * rng.standard_normal(1 << 16, np.float32))

  def take(shape, name):
    n = int(np.prod(shape))
    if "norm" in name:
      return np.resize(norms, n).reshape(shape)
    start = int(rng.integers(0, pool.size))
    return np.resize(np.roll(pool, -start)[: min(n, pool.size)], n).reshape(shape)

  writer = ftw.FTWWriter(out_dir, config, "bfloat16", {"kind": "random-init", "seed": seed,
                                                       "generator": "benchmarks/decode_e2e.py"})
  shapes = {n: tuple(a.shape) for n, a in abstract_params(config).items()}
  parts = ftw.expert_part_shapes(config)
  bar = Progress(len(shapes) + config.num_moe_layers * config.num_experts, desc="write model")
  for name, shape in shapes.items():
    writer.add_tensor(name, take(shape, name))
    bar.update()
  for layer in range(config.num_moe_layers):
    for expert in range(config.num_experts):
      for part, shape in parts.items():
        writer.add_expert_part(layer, expert, part, take(shape, part))
      bar.update()
  bar.close()
  return writer.close()


def load_bench_model(layers: int, model_dir: str, write: bool):
  """The ``layers``-layer Qwen3-30B-A3B-shaped model in ``model_dir``, written there first
  (when ``write``) if it is missing or its config differs; loaded pre-faulted."""
  import ftjax  # noqa: PLC0415
  from ftjax.formats import ftw  # noqa: PLC0415
  config = qwen3_30b_shape(layers)
  path = os.path.join(model_dir, f"{layers}l")
  if not (ftw.is_ftw_dir(path) and ftw.FTWFile.open(path, verify=False).config == config):
    if not write:
      raise RuntimeError(f"{path} is missing or stale; the current side writes it")
    shutil.rmtree(path, ignore_errors=True)
    write_model(config, path)
  t0 = time.perf_counter()
  model = ftjax.load(path, verify=False, populate=True)
  log(f"loaded and pre-faulted {path} in {time.perf_counter() - t0:.1f} s")
  return model


def bytes_per_token(model) -> int:
  """Weights one decode step reads: all dense tensors but the embedding, top-k experts."""
  c = model.config
  dense = sum(t["nbytes"] for n, t in model.storage.index["tensors"].items() if n != "embed_vd")
  expert = c.expert_block_elems * model.dtype.itemsize
  return dense + c.num_layers * c.top_k * expert


def read_bandwidth(buf, repeats: int = 3) -> float:
  """Bytes per second of the fastest of ``repeats`` read probes over ``buf`` (after one)."""
  from ftjax.kernels import read_probe  # noqa: PLC0415
  read_probe(buf).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    read_probe(buf).block_until_ready()
    times.append(time.perf_counter() - t0)
  return buf.nbytes / min(times)


# Model-config fields added after a174ea7, with the values that leave them unused (every
# family but the hybrid ones). A baseline that predates a field can run a model that has it at
# this value.
UNUSED_NEWER_FIELDS = {
    "attn_output_gate": False, "norm_zero_centred": False, "partial_rotary_factor": 1.0,
    "linear_conv_kernel": 0, "linear_key_head_dim": 0, "linear_num_key_heads": 0,
    "linear_num_value_heads": 0, "linear_value_head_dim": 0, "vision_token_ids": [],
}


def default_model_view(path: str) -> str:
  """``path`` if this worker's ftjax knows every field of its model config; otherwise a view
  of it in the working directory (the cache dir): symlinks to its files and an ``ftw.json``
  without the fields this ftjax predates, each of which must be at its unused value."""
  import dataclasses  # noqa: PLC0415

  from ftjax.model.config import ModelConfig  # noqa: PLC0415
  with open(os.path.join(path, "ftw.json")) as f:
    index = json.load(f)
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  extra = sorted(set(index["model_config"]) - known)
  if not extra:
    return path
  used = [k for k in extra if UNUSED_NEWER_FIELDS.get(k, object()) != index["model_config"][k]]
  if used:
    raise RuntimeError(f"this side's ftjax cannot run the default model in {path}: it predates "
                       f"the config fields {used}, which that model uses; pick a later "
                       "--baseline")
  for k in extra:
    del index["model_config"][k]
  view = os.path.abspath("default-model-view")
  shutil.rmtree(view, ignore_errors=True)
  os.makedirs(view)
  for name in os.listdir(path):
    if name != "ftw.json":
      os.symlink(os.path.join(path, name), os.path.join(view, name))
  with open(os.path.join(view, "ftw.json"), "w") as f:
    json.dump(index, f)
  log(f"default model: a view of {path} without the config fields {extra} (all unused)")
  return view


def log(msg: str) -> None:
  print(f"[{os.environ.get('DECODE_E2E_SIDE', 'worker')}] {msg}", file=sys.stderr, flush=True)


class Worker:
  """Both models and their engines, loaded and compiled once; ``measure`` is one round."""

  def __init__(self, args):
    import numpy as np  # noqa: PLC0415

    import ftjax  # noqa: PLC0415
    from ftjax.runtime.tokenizer import load_tokenizer  # noqa: PLC0415
    try:
      from ftjax.assets import DEFAULT_MODEL_DIR  # noqa: PLC0415
    except ImportError:  # before engine v2
      from ftjax.tiny import DEFAULT_MODEL_DIR  # noqa: PLC0415
    self.args = args
    # Both sides decode the current side's default model (the embedded one changes with
    # retraining); a baseline that predates some of its config fields reads a view of it.
    self.small_dir = args.default_model_dir or DEFAULT_MODEL_DIR
    if args.default_model_dir:
      self.small_dir = default_model_view(args.default_model_dir)
    self.small = ftjax.load(self.small_dir)
    self.small_engine = ftjax.Engine(self.small, kernels="auto")
    tok = load_tokenizer(self.small.path, self.small.config.vocab_size)
    self.small_prompt = tok.encode(DEFAULT_PROMPT)
    self.big = load_bench_model(args.layers, args.model_dir, write=args.worker == "current")
    self.per_token = bytes_per_token(self.big)
    self.probe = self.big.bank[0]  # one layer of experts (1.2 GB), far larger than the L3
    self.engine = ftjax.Engine(self.big, kernels=args.kernels, max_seq_len=4096)
    prompt = np.random.default_rng(0).integers(0, self.big.config.vocab_size,
                                               args.prefill_tokens).tolist()
    self.prompt, self.short = prompt, prompt[:8]
    t0 = time.perf_counter()
    self.measure()  # compiles every shape the rounds use; discarded
    log(f"warm-up round (compiles) {time.perf_counter() - t0:.1f} s")

  def info(self) -> dict:
    import jax  # noqa: PLC0415

    import ftjax  # noqa: PLC0415
    out = {"ftjax": os.path.dirname(ftjax.__file__), "jax": jax.__version__,
           "bytes_per_token": self.per_token, "default_prompt_tokens": len(self.small_prompt),
           "default_model_dir": self.small_dir}
    for name, engine in (("default", self.small_engine), ("bench", self.engine)):
      out[f"{name}_kernels"] = engine.kernels
      out[f"{name}_kernels_path"] = getattr(engine, "kernels_path", None)  # engine v2 only
    if self.args.worker == "current":
      from common import machine_info  # noqa: PLC0415
      out["machine"] = machine_info()
    return out

  def measure(self) -> dict:
    a = self.args
    small = [self.small_engine.generate_timed(self.small_prompt, a.default_tokens, greedy=True)
             for _ in range(a.default_repeats)]
    bw = read_bandwidth(self.probe)
    dec = self.engine.generate_timed(self.short, a.decode_tokens + 1, greedy=True)
    pre = self.engine.generate_timed(self.prompt, 1, greedy=True)
    step_s = dec.decode_s / (len(dec.tokens) - 1)
    ideal_s = self.per_token / bw
    return {
        "default_decode_tok_s": statistics.median(g.decode_tok_s for g in small),
        "default_decode_tok_s_all": [g.decode_tok_s for g in small],
        "default_new_tokens": len(small[0].tokens),
        "default_programs": getattr(small[0], "programs", None),  # engine v2 only
        "default_tokens": small[0].tokens,
        "read_gb_s": bw / 1e9,
        "decode_new_tokens": len(dec.tokens),
        "decode_programs": getattr(dec, "programs", None),
        "step_ms": step_s * 1e3,
        "roofline_step_ms": ideal_s * 1e3,
        "overhead_ms": (step_s - ideal_s) * 1e3,
        "decode_tok_s": 1 / step_s,
        "roofline_tok_s": 1 / ideal_s,
        "decode_vs_roofline": ideal_s / step_s,
        "prefill_tok_s": pre.prefill_tok_s,
    }

  def xla(self) -> dict:
    """Decode tok/s of the same model with plain XLA:CPU (``kernels="xla"``), for scale."""
    import ftjax  # noqa: PLC0415
    engine = ftjax.Engine(self.big, kernels="xla", max_seq_len=4096)
    engine.generate(self.short, self.args.xla_decode_tokens + 1)  # compiles
    return {"decode_tok_s_xla": engine.generate_timed(
        self.short, self.args.xla_decode_tokens + 1, greedy=True).decode_tok_s}


def worker_main(args) -> None:
  """Answers one JSON line on the original stdout per request line on stdin."""
  reply = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)  # anything else printed (progress, kernel notices) goes to stderr
  worker = Worker(args)
  ops = {"info": worker.info, "measure": worker.measure, "xla": worker.xla}
  reply.write(json.dumps({"ready": True}) + "\n")
  reply.flush()
  for line in sys.stdin:
    op = line.strip()
    if op == "quit":
      break
    reply.write(json.dumps(ops[op]()) + "\n")
    reply.flush()


# -- Driver side: builds the baseline, runs the workers, reports. ------------------------------

def git(*cmd: str) -> str:
  return subprocess.run(["git", "-C", REPO, *cmd], check=True, capture_output=True,
                        text=True).stdout.strip()


def build_baseline(rev: str, cache_dir: str) -> tuple[str, str]:
  """(sha, site dir) of ftjax at ``rev``, built into ``cache_dir`` unless already there."""
  sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
  root = os.path.join(cache_dir, f"baseline-{sha[:12]}")
  site = os.path.join(root, "site")
  if os.path.isfile(os.path.join(site, "ftjax", "__init__.py")):
    print(f"baseline {rev} ({sha[:12]}): reusing the build in {site}")
    return sha, site
  os.makedirs(root, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix="ftjax-baseline-")
  tree, partial = os.path.join(tmp, "worktree"), os.path.join(tmp, "site")
  build_log = os.path.join(root, "build.log")
  git("worktree", "add", "--detach", tree, sha)
  try:
    print(f"baseline {rev} ({sha[:12]}): building in a temporary worktree {tree} "
          f"(~2-3 min on 2 cores; log {build_log})", flush=True)
    t0, next_note = time.perf_counter(), 20
    with open(build_log, "w") as f:
      proc = subprocess.Popen([sys.executable, "-m", "pip", "install", "--no-build-isolation",
                               "--no-deps", f"--target={partial}", tree],
                              stdout=f, stderr=subprocess.STDOUT, cwd=tmp)
      while proc.poll() is None:
        time.sleep(1)
        if time.perf_counter() - t0 >= next_note:
          print(f"  building... {next_note} s", flush=True)
          next_note += 20
    if proc.returncode:
      with open(build_log) as f:
        tail = f.read()[-3000:]
      raise RuntimeError(f"building {rev} failed (exit {proc.returncode}):\n{tail}")
    shutil.move(partial, site)
    print(f"  built in {time.perf_counter() - t0:.0f} s")
  finally:
    subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], check=False)
    shutil.rmtree(tmp, ignore_errors=True)
  return sha, site


class Side:
  """One worker process: ``ask(op)`` sends a request and returns its JSON answer."""

  def __init__(self, name: str, pythonpath: str | None, args, cwd: str, extra=()):
    env = dict(os.environ, DECODE_E2E_SIDE=name)
    env.pop("PYTHONPATH", None)
    if pythonpath:
      env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, os.path.abspath(__file__), f"--worker={name}",
           f"--layers={args.layers}", f"--model_dir={args.model_dir}",
           f"--kernels={args.kernels}", f"--decode_tokens={args.decode_tokens}",
           f"--prefill_tokens={args.prefill_tokens}", f"--default_tokens={args.default_tokens}",
           f"--default_repeats={args.default_repeats}",
           f"--xla_decode_tokens={args.xla_decode_tokens}", *extra]
    self.name = name
    self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
    self._read()  # {"ready": true} once loaded and compiled

  def _read(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the {self.name} worker exited (code {self.proc.wait()}); its "
                         "messages are above")
    return json.loads(line)

  def ask(self, op: str) -> dict:
    self.proc.stdin.write(op + "\n")
    self.proc.stdin.flush()
    return self._read()

  def close(self) -> None:
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()


def differing_files(package: str, source: str) -> list[str]:
  """The .py files of ``source`` (the checkout) that ``package`` (imported) lacks or differs in."""
  out = []
  for root, _, files in os.walk(source):
    for name in files:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(root, name), source)
        other = os.path.join(package, rel)
        if not (os.path.isfile(other) and filecmp.cmp(os.path.join(root, name), other, False)):
          out.append(rel)
  return out


def median(rows: list[dict], key: str):
  values = [r[key] for r in rows if r.get(key) is not None]
  return statistics.median(values) if values else None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--baseline", default="a174ea7",
                      help="git rev measured as 'before'; 'none' measures the current side only")
  parser.add_argument("--current_src", action="store_true",
                      help="current side imports this checkout's src/ instead of the installed "
                      "ftjax")
  parser.add_argument("--cache_dir", default="/tmp/ftjax-bench",
                      help="baseline builds (baseline-<sha>/site), reused while present")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--model_dir", default="/tmp/ftjax-bench/qwen3-30b-a3b-shape")
  parser.add_argument("--kernels", default="ffi_bf16", choices=["ffi", "ffi_bf16"],
                      help="kernels of the 30B-shaped model (ffi_bf16: bf16 activations)")
  parser.add_argument("--decode_tokens", type=int, default=32,
                      help="decode steps per round on the 30B-shaped model")
  parser.add_argument("--prefill_tokens", type=int, default=512)
  parser.add_argument("--default_tokens", type=int, default=128,
                      help="new tokens per default-model generation")
  parser.add_argument("--default_repeats", type=int, default=3,
                      help="default-model generations per round (their median)")
  parser.add_argument("--xla_decode_tokens", type=int, default=4,
                      help="decode tokens with kernels=xla on the current side (0 to skip)")
  parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
  parser.add_argument("--default_model_dir", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker_main(args)
    return

  t_start = time.perf_counter()
  os.makedirs(args.cache_dir, exist_ok=True)
  baseline = None if args.baseline == "none" else build_baseline(args.baseline, args.cache_dir)
  paths = {"current": os.path.join(REPO, "src") if args.current_src else None}
  if baseline:
    paths["baseline"] = baseline[1]
  sides: dict[str, Side] = {}
  try:
    # The current side first: it writes the 30B-shaped model when it is missing.
    for name in ("current", "baseline"):
      if name in paths:
        print(f"starting the {name} worker (loads both models, compiles)", flush=True)
        t0 = time.perf_counter()
        extra = ()
        if name == "baseline":  # decodes the current side's default model
          extra = (f"--default_model_dir={sides['current'].ask('info')['default_model_dir']}",)
        sides[name] = Side(name, paths[name], args, cwd=args.cache_dir, extra=extra)
        print(f"  {name} ready in {time.perf_counter() - t0:.0f} s", flush=True)
    info = {name: side.ask("info") for name, side in sides.items()}
    machine = info["current"].pop("machine")
    stale = differing_files(info["current"]["ftjax"], os.path.join(REPO, "src", "ftjax"))
    if stale:
      print(f"WARNING: the current side imports ftjax from {info['current']['ftjax']}, which "
            f"differs from this checkout's src/ftjax in {len(stale)} files "
            f"({', '.join(stale[:4])}...): reinstall it or pass --current_src", flush=True)
    order = [s for s in ("baseline", "current") if s in sides]
    rounds: dict[str, list[dict]] = {s: [] for s in order}
    for r in range(args.rounds):
      for name in order:
        row = sides[name].ask("measure")
        rounds[name].append(row)
        print(f"round {r} {name:>8}: default {row['default_decode_tok_s']:7.1f} tok/s | 30B: "
              f"read {row['read_gb_s']:5.1f} GB/s, step {row['step_ms']:6.2f} ms (roofline "
              f"{row['roofline_step_ms']:5.2f}, overhead {row['overhead_ms']:6.2f}), "
              f"{row['decode_vs_roofline']:.2f} of roofline, prefill "
              f"{row['prefill_tok_s']:5.0f} tok/s", flush=True)
    xla = {}
    if args.xla_decode_tokens:
      t0 = time.perf_counter()
      xla = sides["current"].ask("xla")
      print(f"kernels=xla on the current side: {xla['decode_tok_s_xla']:.2f} tok/s "
            f"({time.perf_counter() - t0:.0f} s with its compile)", flush=True)
  finally:
    for side in sides.values():
      side.close()

  keys = [k for k in rounds["current"][0] if not isinstance(rounds["current"][0][k], list)]
  med = {s: {k: median(rounds[s], k) for k in keys} for s in order}
  cur, base = med["current"], med.get("baseline")
  speedup = cur["default_decode_tok_s"] / base["default_decode_tok_s"] if base else None
  goals = {
      "default_decode_speedup": {"goal": f">= {GOAL_DEFAULT_SPEEDUP}", "value": speedup,
                                 "met": None if speedup is None
                                 else speedup >= GOAL_DEFAULT_SPEEDUP},
      "overhead_ms": {"goal": f"<= {GOAL_OVERHEAD_MS}", "value": cur["overhead_ms"],
                      "met": cur["overhead_ms"] <= GOAL_OVERHEAD_MS},
      "decode_vs_roofline": {"goal": f">= {GOAL_ROOFLINE}", "value": cur["decode_vs_roofline"],
                             "met": cur["decode_vs_roofline"] >= GOAL_ROOFLINE},
  }
  same_tokens = (all(rounds["baseline"][i]["default_tokens"] == rounds["current"][i]
                     ["default_tokens"] for i in range(args.rounds)) if base else None)

  def row(label, key, fmt, goal=""):
    b = format(base[key], fmt) if base else "-"
    ratio = f"{cur[key] / base[key]:.2f}x" if base else ""
    print(f"  {label:<34} {b:>12} {format(cur[key], fmt):>12} {ratio:>8}  {goal}")

  def met(name):
    m = goals[name]["met"]
    return "" if m is None else f"goal {goals[name]['goal']}: {'met' if m else 'NOT met'}"

  rev = f"{args.baseline} ({baseline[0][:12]})" if baseline else "none"
  print(f"\nmedians over {args.rounds} rounds; baseline {rev}, current "
        f"{info['current']['ftjax']}")
  print(f"  {'':<34} {'before':>12} {'after':>12} {'ratio':>8}")
  print(f"  default model ({args.default_tokens} new tokens, kernels=auto)")
  row("decode tok/s", "default_decode_tok_s", ".1f", met("default_decode_speedup"))
  print(f"  {args.layers}-layer Qwen3-30B-A3B shape (kernels={args.kernels}, "
        f"{info['current']['bytes_per_token'] / 1e9:.3f} GB per token)")
  row("read bandwidth GB/s", "read_gb_s", ".1f")
  row("step ms", "step_ms", ".2f")
  row("roofline step ms (bytes / read)", "roofline_step_ms", ".2f")
  row("per-token overhead ms", "overhead_ms", ".2f", met("overhead_ms"))
  row("decode / roofline", "decode_vs_roofline", ".3f", met("decode_vs_roofline"))
  row("decode tok/s", "decode_tok_s", ".1f")
  row(f"prefill {args.prefill_tokens} tokens tok/s", "prefill_tok_s", ".0f")
  if xla:
    print(f"  decode with kernels=xla (current)  {xla['decode_tok_s_xla']:.2f} tok/s")
  if same_tokens is not None:
    print(f"  default-model tokens equal before and after: {same_tokens}")
  runtime = time.perf_counter() - t_start
  out = write_results("decode_e2e", {
      "machine": machine, "baseline_rev": args.baseline,
      "baseline_sha": baseline[0] if baseline else None,
      "current_src": args.current_src, "current_differs_from_checkout": stale,
      "workers": info, "config": {"layers": args.layers, "kernels": args.kernels,
                                  "default_prompt": DEFAULT_PROMPT},
      "goals": goals, "median": med, "rounds": rounds, "default_tokens_equal": same_tokens,
      "decode_tok_s_xla": xla.get("decode_tok_s_xla"), "runtime_s": runtime,
      "args": vars(args)})
  print(f"wrote {out} ({runtime:.0f} s in all)")


if __name__ == "__main__":
  main()
