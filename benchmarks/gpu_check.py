"""The GPU path on a lent GPU machine, in one run of at most ~8 minutes (issue 14).

  python benchmarks/gpu_check.py                 # on the GPU machine, from the checkout root
  python benchmarks/gpu_check.py --dry_run       # here, on the CPU: every stage that can run
                                                 # (1 layer, shorter rounds: ~2.5 min, 9 GB)

On the lent machine (the device tool's ``run``, ``timeout_s`` about 590): the script writes its
results after every stage and, when ``$OUT`` is set, copies them to ``$OUT/gpu/`` too, so they
come back even if the run is cut short; at the end of ``--budget_s`` (build included) a
watchdog writes what it has and exits. Copy ``$OUT/gpu/`` to ``benchmarks/results/gpu/`` and
commit it.

Stages, each timed, each failure recorded (the run goes on to the next stage), results written
to ``benchmarks/results/gpu/gpu_check.json`` after every stage (``--dry_run``: under
``benchmarks/results/gpu/dry_run_cpu/``):

1. build: ``pip install --no-build-isolation --no-deps -C cmake.define.FTJAX_CUDA=ON .``, then
   the script re-executes itself on the installed package;
2. machine: GPU, driver, jax, CPU ISA, whether ``ftjax._ffi_cuda`` loaded;
3. correctness: ``pytest tests/gpu`` where pytest is installed; where it is not, or fails, a
   built-in check of the same engine cases (both GPU placements, every policy at sizes 0, 1,
   L·E/3, L·E, against the dense path with the whole pool in device memory); then quantised
   dense weights (every ``--dense_dtype``) against their float32 dequantisation;
4. model: a ``--layers``-layer Qwen3-30B-A3B-shaped model (random bf16) written straight to
   FTW with numpy, then loaded and pre-faulted;
5. profile: B_P (CUDA copy kernel from the mapped pool, and XLA slices of a pinned_host pool),
   B_H (the CPU kernel), both concurrently (``ftjax.runtime.profile``), and the device's read
   bandwidth;
6. decode: tok/s and miss rates of freetoken, lru_fill and cpu_only at 10%, 37% and 100% of the
   experts, each against the cost model's prediction from the measured profile and the run's
   own per-step counts (``ftjax.research.cost``, and DESIGN section 2's DMA/host contention
   model, which the library's cost model gains in issue 17); freetoken at 37% on the other
   placement too. freetoken calibrates its q* split while decoding (``calibrate_split``:
   ``ftjax.runtime.calibration``; each row records the strategy, the fitted fill and host
   rates and the guard's switches), and runs once more at 37% with the profile's split fixed;
   freetoken and lru_fill at 37% also run with router-ahead prefetch of top_k experts per
   layer-step (``prefetch=``: prefetched, used, wasted recorded);
7. overlap: a ``jax.profiler`` trace of a freetoken decode at 37%: GPU busy time from the
   trace, host-expert time from the CUDA module's counters, and how much of the smaller one
   the step hid behind the other;
8. prefill: 512 and 2048 tokens with whole layers streamed against sparse fills plus host
   experts, next to the transfer-bound ceiling of streaming.

Goals (the issue): decode at 37% within 1.2x of the cost model; freetoken >= lru_fill and >=
cpu_only at every budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results", "gpu")
POLICIES = ("freetoken", "lru_fill", "cpu_only")
FRACTIONS = (0.10, 0.37, 1.0)
GOAL_MODEL_RATIO = 1.2


def log(msg: str) -> None:
  print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def memory_now() -> dict:
  """This process's resident memory (GB): now (anonymous, file-backed) and its peak since the
  last ``reset_peak`` (VmHWM: anonymous and file pages together)."""
  out = {}
  with open("/proc/self/status") as f:
    for line in f:
      key, _, value = line.partition(":")
      if key in ("VmHWM", "RssAnon", "RssFile"):
        out[{"VmHWM": "peak_rss_gb", "RssAnon": "anon_gb", "RssFile": "file_gb"}[key]] = round(
            int(value.split()[0]) * 1024 / 1e9, 3)
  return out


def reset_peak() -> None:
  """Starts a new VmHWM window (Linux: writing 5 to clear_refs resets the peak to the RSS now)."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    pass  # the peak then covers the process so far


def host_memory_plan(layers: int, dry_run: bool) -> dict:
  """What the run expects to hold in host memory at its peak (GB), stage by stage, before it
  starts. The pool is the Qwen3-30B-A3B-shaped bank (9.44 MB an expert, 128 a layer), mapped
  from its FTW file and pre-faulted (file pages: the kernel can drop them, but they are counted).

  * GPU: the pool, its pinned_host copy (the ``auto`` placement under XLA's pinned cap; the
    ``mapped`` row registers the file's pages instead), dense weights, and jax/XLA itself. The
    expert cache is in device memory.
  * Dry run (CPU): device memory is host memory, so the largest cache (all experts) is host
    memory too; the ``pinned_host`` row adds the pinned copy and its programs' temporaries,
    about three pools (XLA:CPU widens the bfloat16 pool to float32 for its slices and hoists
    that out of the decode loop: ``memory_analysis`` of the compiled decode program gives 3.6 GB
    for a 1.2 GB pool; ``ftjax.runtime.programs.check_host_memory`` refuses such a program
    with a clear error where it would not fit). The rows run one at a time: a dropped
    engine's cache and pinned copy are freed before the next (tests/runtime/test_engine_memory.py).
  """
  from decode_e2e import qwen3_30b_shape  # noqa: PLC0415
  c = qwen3_30b_shape(layers)
  gb = 1e9
  expert = c.expert_block_elems * 2
  pool = layers * c.num_experts * expert / gb
  dense = (2 * c.vocab_size * c.hidden_size * 2
           + layers * 2 * (c.num_heads + c.num_kv_heads) * c.head_dim * c.hidden_size * 2) / gb
  runtime = 3.0  # jax, XLA, compiled programs, the builtin check's engines
  base = pool + dense + runtime
  if dry_run:
    slots = 1 << (layers * c.num_experts - 1).bit_length()  # the all-experts cache's bucket
    at_37 = 1 << (int(0.37 * layers * c.num_experts) - 1).bit_length()
    peaks = {"decode, all experts cached": base + slots * expert / gb,
             "decode, pinned_host row": base + pool + at_37 * expert / gb + 3 * pool}
  else:
    peaks = {"decode (pinned_host pool)": base + pool}
  total = _mem_total_gb()
  peak = max(peaks.values())
  return {"pool_gb": round(pool, 2), "dense_gb": round(dense, 2), "runtime_gb": runtime,
          "peaks_gb": {k: round(v, 1) for k, v in peaks.items()},
          "expected_peak_gb": round(peak, 1), "mem_total_gb": round(total, 1),
          "fits": peak <= 0.8 * total}


def _mem_total_gb() -> float:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemTotal:"):
        return int(line.split()[1]) * 1024 / 1e9
  raise RuntimeError("no MemTotal in /proc/meminfo")


class Run:
  """The results so far, written after every stage."""

  def __init__(self, args):
    self.args = args
    self.t0 = time.perf_counter() - (args.build_s or 0.0)  # the build counts in the budget
    self.results = {"args": vars(args), "stages": {}}
    self.current = None
    os.makedirs(RESULTS, exist_ok=True)
    # A hang (a stream waiting on a host flag that never comes, say) must not lose the run:
    # at the end of the budget the results so far are written and the process exits.
    threading.Thread(target=self._watchdog, daemon=True).start()

  def _watchdog(self):
    while self.left_s() > 0:
      time.sleep(2)
    self.results["watchdog"] = (f"the budget of {self.args.budget_s:.0f} s ran out during "
                                f"stage {self.current!r}; the process was ended")
    self.write()
    log(self.results["watchdog"])
    os._exit(3)

  def left_s(self) -> float:
    return self.args.budget_s - (time.perf_counter() - self.t0)

  def stage(self, name, fn, *, min_left_s: float = 0.0):
    if self.left_s() < min_left_s:
      self.results["stages"][name] = {"skipped": f"{self.left_s():.0f} s left of the budget"}
      log(f"{name}: skipped (time)")
      self.write()
      return None
    log(f"{name} ...")
    self.current = name
    reset_peak()
    t0 = time.perf_counter()
    entry = {}
    try:
      value = fn()
      entry["result"] = value
      ok = True
    except Exception as e:  # every failure is recorded, and the next stage still runs
      entry["error"] = f"{type(e).__name__}: {e}"
      entry["traceback"] = traceback.format_exc()[-4000:]
      value, ok = None, False
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    entry["memory"] = memory_now()  # peak_rss_gb: this stage's peak
    self.results["stages"][name] = entry
    self.results["peak_rss_gb"] = max(self.results.get("peak_rss_gb", 0.0),
                                      entry["memory"]["peak_rss_gb"])
    log(f"{name}: {'ok' if ok else 'FAILED: ' + entry['error']} ({entry['seconds']} s, peak RSS "
        f"{entry['memory']['peak_rss_gb']:.1f} GB)")
    self.write()
    return value

  def write(self):
    path = os.path.join(RESULTS, "gpu_check.json")
    with open(path, "w") as f:
      json.dump(self.results, f, indent=1, default=str)
    mirror = os.environ.get("OUT")  # the device tool returns only what lies under $OUT
    if mirror:
      shutil.copytree(RESULTS, os.path.join(mirror, "gpu"), dirs_exist_ok=True)
    return path


# -- Stages ---------------------------------------------------------------------------------------


def build() -> None:
  """Installs the checkout with its CUDA module, then re-executes on the installed package."""
  command = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
             "-C", "cmake.define.FTJAX_CUDA=ON", "."]
  log(" ".join(command))
  t0 = time.perf_counter()
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
  with open(os.path.join(RESULTS, "build.log"), "w") as f:
    f.write(done.stdout[-20000:] + "\n" + done.stderr[-20000:])
  log(f"build: rc={done.returncode} in {time.perf_counter() - t0:.0f} s")
  if done.returncode != 0:
    print(done.stderr[-3000:], flush=True)
  os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), "--nobuild",
                            *sys.argv[1:], f"--build_rc={done.returncode}",
                            f"--build_s={time.perf_counter() - t0:.0f}"])


def machine() -> dict:
  import jax  # noqa: PLC0415

  from common import machine_info  # noqa: PLC0415
  from ftjax.kernels import cuda  # noqa: PLC0415
  info = machine_info()
  info["backend"] = jax.default_backend()
  info["devices"] = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
  info["memories"] = [str(m) for m in jax.devices()[0].addressable_memories()]
  info["ffi_cuda"] = "loaded" if cuda.cuda_available() else cuda.cuda_load_error()
  try:
    info["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
         "pcie.link.width.current", "--format=csv,noheader"], capture_output=True, text=True,
        timeout=20, check=False).stdout.strip()
  except (OSError, subprocess.TimeoutExpired) as e:
    info["nvidia_smi"] = f"unavailable: {e}"
  return info


def pytest_gpu() -> dict:
  import importlib.util  # noqa: PLC0415
  if importlib.util.find_spec("pytest") is None:
    return {"skipped": "pytest is not installed here; the built-in check runs instead"}
  done = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-x", "-rs",
                         "-p", "no:cacheprovider"], cwd=REPO, capture_output=True, text=True,
                        timeout=150, check=False)
  return {"rc": done.returncode, "tail": (done.stdout + done.stderr)[-4000:]}


def builtin_check(dry_run: bool) -> dict:
  """The engine on the GPU placements against the dense path, every policy and four sizes."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  from ftjax.cache import POLICIES as ALL  # noqa: PLC0415
  from ftjax.kernels import cuda  # noqa: PLC0415
  from ftjax.model.config import ModelConfig  # noqa: PLC0415
  from ftjax.runtime.model import random_model  # noqa: PLC0415
  config = ModelConfig(
      model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=8, num_experts=8, top_k=2, moe_intermediate_size=16,
      rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
      layer_types=("full_attention",) * 2, qk_norm="per_head", norm_topk_prob=True)
  model = random_model(config, seed=3)
  model = dataclasses.replace(model, params=jax.tree.map(lambda x: x * 8.0, model.params))
  prompt = [3, 14, 15, 9, 2]
  kernels = "ffi" if dry_run else "xla"
  reference = ftjax.Engine(model, kernels=kernels).generate(prompt, 12)
  ref_logits = _logits(ftjax.Engine(model, kernels=kernels), prompt)
  total = config.num_layers * config.num_experts
  pools = ["pinned_host"] if dry_run else ["pinned_host", "mapped"]
  out = {"cases": 0, "mismatches": []}
  for pool in pools:
    for policy in ALL:
      for slots in (0, 1, total // 3, total):
        engine = ftjax.Engine(model, kernels=kernels, cache_slots=slots, policy=policy,
                              bandwidths=(12.0, 24.0), hot_experts=np.arange(total)[::-1],
                              pool=pool, cache_capacity=total)
        tokens = engine.generate(prompt, 12)
        err = float(np.max(np.abs(_logits(engine, prompt) - ref_logits)))
        out["cases"] += 1
        if tokens != reference or err > 1e-5 * max(1.0, float(np.abs(ref_logits).max())):
          out["mismatches"].append({"pool": pool, "policy": policy, "slots": slots,
                                    "tokens": tokens, "reference": reference,
                                    "max_logit_error": err})
  if cuda.cuda_available() and not dry_run:
    out["cuda_stats"] = cuda.pool_stats()
  out["passed"] = not out["mismatches"]
  return out


def quantised_dense_check(dry_run: bool) -> dict:
  """Quantised dense weights (--dense_dtype: int8, int4, mxfp4 and the presets) on the device:
  the engine's logits and greedy tokens against the same model with those weights dequantised
  to float32 (XLA dequantises them inside the step programs on a GPU)."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  from ftjax.formats import ftw  # noqa: PLC0415
  from ftjax.model.config import ModelConfig  # noqa: PLC0415
  from ftjax.runtime import model as model_lib  # noqa: PLC0415
  config = ModelConfig(
      model_type="qwen3_moe", vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=32,
      rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
      layer_types=("full_attention",) * 2, qk_norm="per_head", norm_topk_prob=True)
  model = model_lib.random_model(config, seed=4)
  model = dataclasses.replace(model, params=jax.tree.map(lambda x: x * 4.0, model.params))
  prompt = [3, 14, 15, 9, 2]
  kernels = "ffi" if dry_run else "xla"
  out = {"device": str(jax.devices()[0]), "cases": {}}
  for dense_dtype in ftw.DENSE_DTYPES:
    q = model_lib.quantize_dense(model, dense_dtype)
    deq = model_lib.dequantize_dense(q)
    tokens = ftjax.Engine(q, kernels=kernels).generate(prompt, 8)
    ref = ftjax.Engine(deq, kernels=kernels).generate(prompt, 8)
    got_logits = _logits(ftjax.Engine(q, kernels=kernels), prompt)
    ref_logits = _logits(ftjax.Engine(deq, kernels=kernels), prompt)
    err = float(np.max(np.abs(got_logits - ref_logits)) /
                max(1.0, float(np.abs(ref_logits).max())))
    out["cases"][dense_dtype] = {"formats": q.dense_formats, "tokens_equal": tokens == ref,
                                 "max_logit_error": err}
  out["passed"] = all(c["tokens_equal"] and c["max_logit_error"] <= 1e-5
                      for c in out["cases"].values())
  return out


def _logits(engine, prompt):
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  state = engine.new_state(1, 32)
  _, logits = engine.step(state, jnp.asarray([prompt], jnp.int32),
                          jnp.arange(len(prompt), dtype=jnp.int32)[None], last_only=True)
  return np.asarray(logits[0, -1])


def write_model(config, path: str, seed: int = 0) -> str:
  """Random bf16 weights straight to FTW: contiguous slices of one random pool."""
  import ml_dtypes  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from ftjax.formats import ftw  # noqa: PLC0415
  from ftjax.model import abstract_params  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  pool = (rng.standard_normal(1 << 24, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
  norms = 1.0 + 0.1 * rng.standard_normal(1 << 16, np.float32)

  def take(shape, name):
    n = int(np.prod(shape))
    if "norm" in name:
      return np.resize(norms, n).reshape(shape)
    if n <= pool.size:
      start = int(rng.integers(0, pool.size - n + 1))
      return pool[start:start + n].reshape(shape)
    return np.resize(pool, n).reshape(shape)

  writer = ftw.FTWWriter(path, config, "bfloat16", {"kind": "random-init", "seed": seed,
                                                    "generator": "benchmarks/gpu_check.py"})
  for name, a in abstract_params(config).items():
    writer.add_tensor(name, take(tuple(a.shape), name))
  parts = ftw.expert_part_shapes(config)
  for layer in range(config.num_moe_layers):
    for expert in range(config.num_experts):
      for part, shape in parts.items():
        writer.add_expert_part(layer, expert, part, take(shape, part))
    log(f"  wrote layer {layer + 1}/{config.num_layers}")
  return writer.close()


def make_model(args):
  import ftjax  # noqa: PLC0415
  from decode_e2e import qwen3_30b_shape  # noqa: PLC0415
  from ftjax.formats import ftw  # noqa: PLC0415
  config = qwen3_30b_shape(args.layers)
  path = os.path.join(args.model_dir, f"qwen3-30b-a3b-shape-{args.layers}l")
  if not (ftw.is_ftw_dir(path) and ftw.FTWFile.open(path, verify=False).config == config):
    write_model(config, path)
  model = ftjax.load(path, verify=False, populate=True)
  pool_bytes = int(model.bank.shape[0]) * int(model.bank.shape[1]) * int(model.bank.shape[2]) * 2
  return model, {"path": path, "layers": args.layers, "pool_gb": pool_bytes / 1e9}


def profile(model, rounds: int) -> dict:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from ftjax.runtime import profile as profile_lib  # noqa: PLC0415
  c = model.config
  shape = profile_lib.ExpertShape(c.hidden_size, c.moe_intermediate_size, model.expert_format,
                                  c.top_k)
  result = profile_lib.measure(model.bank, shape, rounds=rounds, calls=20,
                               show_progress=False)
  # The device's own read bandwidth: a reduction over a large array (median of 5).
  big = jnp.ones((1 << 30,), jnp.float32) if jax.default_backend() != "cpu" else \
      jnp.ones((1 << 26,), jnp.float32)
  reduce = jax.jit(lambda a: a.sum())
  reduce(big).block_until_ready()
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    reduce(big).block_until_ready()
    times.append(time.perf_counter() - t0)
  result["device_read_gb_s"] = big.nbytes / statistics.median(times) / 1e9
  del big
  path = profile_lib.save_profile(result, os.path.join(RESULTS, "profile.json"))
  result["path"] = path
  return result


def _hardware(prof):
  from ftjax.research.cost import HardwareProfile  # noqa: PLC0415
  conc = prof["concurrent"]
  return HardwareProfile(
      name="measured", b_p=conc["b_p_gb_s"], b_h=conc["b_p_gb_s"] + conc["b_h_gb_s"],
      device_bw=prof["device_read_gb_s"], layer_overhead_s=5e-5, step_overhead_s=2e-4,
      device_memory_gb=141, source="gpu_check: measured bandwidths (concurrent pair), "
      "overheads assumed as in configs/hardware/h200-host.yaml")


def full_pool_ops(engine) -> list[str]:
  """Instructions of the engine's compiled decode programs that produce an array of the whole
  pool's shape (a copy or a conversion of the pool: each one reads every byte of it per
  program). Only parameters and loop plumbing should mention that shape."""
  bank = "[" + ",".join(str(n) for n in engine.model.bank.shape) + "]"
  instruction = re.compile(r"^(?:ROOT )?%[\w.\-]+ = (\S+) ([\w\-]+)\(")
  found = []
  for key, fn in engine.programs.items():
    if key[0] != "decode":
      continue
    for line in fn.as_text().splitlines():
      m = instruction.match(line.strip())
      if m and bank in m.group(1) and m.group(2) not in (
          "parameter", "get-tuple-element", "tuple", "while", "bitcast"):
        found.append(line.strip()[:200])
  return found


def contention_step_times(hw, shape, hits, fills, host):
  """Seconds per decode step under DESIGN section 2's contention model, which the q* rule
  assumes and ``ftjax.research.cost`` does not model yet (issue 17): the host kernel runs at
  B_res = B_H - B_P while a fill's DMA is active and at B_H after. Counts [steps, layers]."""
  import numpy as np  # noqa: PLC0415
  gb = 1e9
  hits, fills, host = (np.asarray(a, np.float64) for a in (hits, fills, host))
  s = shape.expert_bytes
  dma = fills * s / (hw.b_p * gb)
  device = dma + (hits + fills) * s / (hw.device_bw * gb)
  residual = max(hw.b_h - hw.b_p, 1e-9) * gb
  work = host * s
  during = residual * dma  # bytes the host reads while the DMA runs
  host_time = np.where(work <= during, work / residual, dma + (work - during) / (hw.b_h * gb))
  layers = (np.maximum(device, host_time) + shape.dense_bytes_per_layer / (hw.device_bw * gb)
            + hw.layer_overhead_s)
  return layers.sum(axis=-1) + shape.head_bytes / (hw.device_bw * gb) + hw.step_overhead_s


def decode(model, prof, args, run: Run) -> dict:
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  from ftjax.research.cost import ModelShape, step_times  # noqa: PLC0415
  hw = _hardware(prof)
  shape = ModelShape.from_config(model.config)
  rng = np.random.default_rng(0)
  prompt = [int(t) for t in rng.integers(0, model.config.vocab_size, args.prompt_tokens)]
  # The q* policies calibrate their split while decoding (calibrate_split="auto" with a
  # profile: ftjax.runtime.calibration); one row runs freetoken with the profile's split fixed.
  configs = [(p, f, "auto", "auto", 0) for f in FRACTIONS for p in POLICIES]
  configs.append(("freetoken", 0.37, "mapped" if not args.dry_run else "pinned_host", "auto", 0))
  configs.append(("freetoken", 0.37, "auto", "off", 0))
  # Router-ahead prefetch (issue 52): top_k experts per layer-step named before the layer's
  # attention, copied while it runs; the rows record what was prefetched, used and wasted.
  k = model.config.top_k
  configs += [("freetoken", 0.37, "auto", "auto", k), ("lru_fill", 0.37, "auto", "auto", k)]
  rows = {}
  for policy, fraction, pool, calibrate, prefetch in configs:
    key = (f"{policy}@{fraction}/{pool}" + ("/uncalibrated" if calibrate == "off" else "") +
           (f"/prefetch{prefetch}" if prefetch else ""))
    if run.left_s() < 90:
      rows[key] = {"skipped": "time"}
      continue
    engine = None
    try:
      engine = ftjax.Engine(model, cache_fraction=fraction, policy=policy,
                            profile=prof["path"], pool=pool, decode_chunk=16,
                            calibrate_split=calibrate, prefetch=prefetch)
      engine.generate_timed(prompt, 4)  # compiles the programs
      engine.generate_timed(prompt, args.tokens)  # warms the cache
      tok_s, predicted, contended, miss = [], [], [], []
      for _ in range(args.rounds):
        engine.clear_history()
        r = engine.generate_timed(prompt, args.tokens)
        tok_s.append(r.decode_tok_s)
        st = engine.stats()
        steps = [s for s in st["per_step"] if s["tokens"] == 1]
        counts = [np.array([s[k] for s in steps]) for k in ("hits", "fills", "host")]
        predicted.append(float(1.0 / np.mean(step_times(hw, shape, *counts))))
        contended.append(float(1.0 / np.mean(contention_step_times(hw, shape, *counts))))
        miss.append(float((counts[1].sum() + counts[2].sum())
                          / max(1, sum(c.sum() for c in counts))))
      rows[key] = {"policy": policy, "fraction": fraction, "pool": engine.placement.pool,
                   "placement": engine.placement.description,
                   "tok_s": statistics.median(tok_s), "tok_s_rounds": tok_s,
                   "model_tok_s": statistics.median(predicted),
                   "contention_model_tok_s": statistics.median(contended),
                   "miss_rate": statistics.median(miss), "slots": engine.stats()["slots"],
                   "compile_s": engine.compile_s, "full_pool_ops": full_pool_ops(engine),
                   "calibration": engine.calibration(), "prefetch": engine.stats()["prefetch"]}
      rows[key]["measured_over_model"] = rows[key]["tok_s"] / rows[key]["model_tok_s"]
      log(f"  {key}: {rows[key]['tok_s']:.1f} tok/s (model {rows[key]['model_tok_s']:.1f}), "
          f"miss {rows[key]['miss_rate']:.2f}")
    except Exception as e:  # recorded per configuration
      rows[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
      log(f"  {key}: FAILED {rows[key]['error']}")
    finally:
      del engine  # its cache (and a pinned copy no other engine holds) goes before the next row
      gc.collect()
    rows[key]["memory_after"] = memory_now()  # the peak covers the stage so far
    run.results["decode_partial"] = rows
    run.write()
  goals = {}
  for f in FRACTIONS:
    ft, lf, co = (rows.get(f"{p}@{f}/auto", {}).get("tok_s") for p in POLICIES)
    if None not in (ft, lf, co):
      goals[f"freetoken>=lru_fill,cpu_only@{f}"] = bool(ft >= lf and ft >= co)
  for p in POLICIES:
    r = rows.get(f"{p}@0.37/auto", {})
    if "tok_s" in r:
      ratio = r["tok_s"] / r["model_tok_s"]
      goals[f"{p}@0.37 within {GOAL_MODEL_RATIO}x of the model"] = bool(
          1 / GOAL_MODEL_RATIO <= ratio <= GOAL_MODEL_RATIO)
  return {"rows": rows, "goals": goals, "hardware": hw.to_dict()}


def prefill(model, prof, args, run: Run) -> dict:
  """Prefill tok/s with whole layers streamed against sparse fills plus host experts, at 512
  and 2048 tokens (freetoken, 37% cache), and the transfer-bound ceiling of streaming: every
  expert byte once at the measured B_P."""
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  c = model.config
  auto = ftjax.Engine(model, cache_fraction=0.37, policy="freetoken", profile=prof["path"])
  rows = {"auto_threshold_tokens": auto.runner.stream_min_tokens,
          "auto_source": auto.stream_source}
  del auto
  pool_bytes = c.num_layers * c.num_experts * c.expert_block_elems * 2
  rng = np.random.default_rng(1)
  for tokens in (512, 2048):
    prompt = [int(t) for t in rng.integers(0, c.vocab_size, tokens)]
    for stream in (0, 1):
      key = f"{tokens} tokens, {'streamed' if stream else 'sparse'}"
      if run.left_s() < 60:
        rows[key] = {"skipped": "time"}
        continue
      engine = None
      try:
        engine = ftjax.Engine(model, cache_fraction=0.37, policy="freetoken",
                              profile=prof["path"], stream_prefill_tokens=stream,
                              max_seq_len=4096)
        engine.generate_timed(prompt, 1)  # compile
        times = [engine.generate_timed(prompt, 1).prefill_s for _ in range(2)]
        st = engine.stats()
        rows[key] = {"tok_s": tokens / min(times), "seconds": times,
                     "streamed_layer_steps": st["streamed_layer_steps"], "bytes": st["bytes"],
                     "stream_ceiling_tok_s": tokens / (pool_bytes / (prof["b_p_gb_s"] * 1e9))}
        log(f"  {key}: {rows[key]['tok_s']:.0f} tok/s")
      except Exception as e:  # recorded per configuration
        rows[key] = {"error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()[-3000:]}
        log(f"  {key}: FAILED {rows[key]['error']}")
      finally:
        del engine
        gc.collect()
  return rows


def overlap(model, prof, args) -> dict:
  """GPU busy time (trace) and host-expert time (CUDA module counters) over one decode."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  from ftjax.kernels import cuda  # noqa: PLC0415
  engine = ftjax.Engine(model, cache_fraction=0.37, policy="freetoken", decode_chunk=16,
                        profile=prof["path"])
  prompt = list(range(10, 10 + args.prompt_tokens))
  engine.generate_timed(prompt, args.tokens)
  before = cuda.pool_stats() if cuda.cuda_available() else {}
  trace_dir = os.path.join(args.model_dir, "trace")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    r = engine.generate_timed(prompt, args.tokens)
  after = cuda.pool_stats() if cuda.cuda_available() else {}
  out = {"decode_s": r.decode_s, "prefill_s": r.prefill_s, "tokens": len(r.tokens)}
  if before:
    out["host_jobs"] = after["jobs"] - before["jobs"]
    out["host_s"] = after["host_seconds"] - before["host_seconds"]
    out["wait"] = after["wait"]
  gpu = _trace_gpu_busy(trace_dir)
  out.update(gpu)
  wall = r.decode_s + r.prefill_s
  if "gpu_busy_s" in out and "host_s" in out:
    small = min(out["gpu_busy_s"], out["host_s"])
    hidden = out["gpu_busy_s"] + out["host_s"] - wall
    out["overlap_of_smaller"] = float(np.clip(hidden / small, 0, 1)) if small > 0 else None
  return out


def _trace_gpu_busy(trace_dir: str) -> dict:
  paths = []
  for root, _, files in os.walk(trace_dir):
    paths += [os.path.join(root, f) for f in files if f.endswith(".json.gz")]
  if not paths:
    return {"trace": f"no perfetto trace under {trace_dir}"}
  with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name" and "args" in e}
  gpu_pids = {p for p, n in names.items() if "gpu" in n.lower() or "/device:" in n.lower()
              and "cpu" not in n.lower()}
  busy, kernels = 0.0, {}
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu_pids:
      busy += e.get("dur", 0) * 1e-6
      for name in ("PoolFill", "AddHostPart", "SpinWait"):
        if name in e.get("name", ""):
          kernels[name] = kernels.get(name, 0.0) + e.get("dur", 0) * 1e-6
  return {"gpu_busy_s": busy, "ftjax_kernels_s": kernels,
          "trace_processes": sorted(set(names.values()))[:20]}


def plot(decode_result, title: str) -> str | None:
  from common import pyplot  # noqa: PLC0415
  plt = pyplot()
  if plt is None:
    return None
  fig, ax = plt.subplots(figsize=(6, 4))
  for policy in POLICIES:
    xs, ys, ms = [], [], []
    for f in FRACTIONS:
      r = decode_result["rows"].get(f"{policy}@{f}/auto", {})
      if "tok_s" in r:
        xs.append(f)
        ys.append(r["tok_s"])
        ms.append(r["model_tok_s"])
    line, = ax.plot(xs, ys, "o-", label=f"{policy} measured")
    ax.plot(xs, ms, "x--", color=line.get_color(), label=f"{policy} cost model")
  ax.set_title(title, fontsize=9)
  ax.set_xlabel("cache fraction of all experts")
  ax.set_ylabel("decode tok/s")
  ax.legend(fontsize=7)
  path = os.path.join(RESULTS, "decode_tok_s.png")
  fig.savefig(path, dpi=120, bbox_inches="tight")
  return path


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--nobuild", action="store_true", help="use the installed ftjax as is")
  parser.add_argument("--dry_run", action="store_true",
                      help="CPU backend: run every stage that does not need CUDA")
  parser.add_argument("--layers", type=int, default=None,
                      help="layers of the Qwen3-30B-A3B-shaped model (default 8 on the GPU, "
                      "1 for --dry_run: see host_memory_plan)")
  parser.add_argument("--model_dir", default="/tmp/ftjax-gpu-check")
  parser.add_argument("--tokens", type=int, default=None,
                      help="decode tokens per round (default 48; 16 for --dry_run)")
  parser.add_argument("--prompt_tokens", type=int, default=32)
  parser.add_argument("--rounds", type=int, default=None,
                      help="timed decode rounds (default 3; 1 for --dry_run)")
  parser.add_argument("--profile_rounds", type=int, default=None,
                      help="bandwidth profile rounds (default 3; 1 for --dry_run)")
  parser.add_argument("--budget_s", type=float, default=480.0)
  parser.add_argument("--build_rc", type=int, default=None)
  parser.add_argument("--build_s", type=float, default=None)
  args = parser.parse_args()
  if args.dry_run:  # a CPU run's numbers never mix with the GPU's
    global RESULTS
    RESULTS = os.path.join(RESULTS, "dry_run_cpu")
  # The dry run exercises every stage on the CPU (its numbers say nothing about a GPU), sized
  # to fit a 24 GiB development machine in about 2.5 minutes.
  for name, gpu, dry in (("layers", 8, 1), ("tokens", 48, 16), ("rounds", 3, 1),
                         ("profile_rounds", 3, 1)):
    if getattr(args, name) is None:
      setattr(args, name, dry if args.dry_run else gpu)
  plan = host_memory_plan(args.layers, args.dry_run)
  log(f"host memory expected at the peak: {plan['expected_peak_gb']:.1f} GB of "
      f"{plan['mem_total_gb']:.0f} GB ({plan['peaks_gb']}; pool {plan['pool_gb']} GB)")
  if not plan["fits"]:
    sys.exit(f"gpu_check: {args.layers} layers would need about {plan['expected_peak_gb']:.0f} "
             f"GB of host memory at the peak, over 80% of this machine's "
             f"{plan['mem_total_gb']:.0f} GB: give fewer --layers")
  if not args.nobuild and not args.dry_run:
    build()  # re-executes
  run = Run(args)
  run.results["host_memory_plan"] = plan
  if args.build_rc is not None:
    run.results["stages"]["build"] = {"rc": args.build_rc, "seconds": args.build_s,
                                      "log": "benchmarks/results/gpu/build.log"}
  run.stage("machine", machine)
  tested = None
  if not args.dry_run:
    tested = run.stage("pytest_gpu", pytest_gpu, min_left_s=300)
  if not (tested and tested.get("rc") == 0):  # the same check, without pytest
    run.stage("builtin_check", lambda: builtin_check(args.dry_run), min_left_s=250)
  run.stage("quantised_dense", lambda: quantised_dense_check(args.dry_run), min_left_s=230)
  made = run.stage("model", lambda: make_model(args), min_left_s=200)
  if made is None:
    return
  model, info = made
  run.results["stages"]["model"]["result"] = info
  prof = run.stage("profile", lambda: profile(model, args.profile_rounds), min_left_s=150)
  if prof is None:
    return
  holder = None
  if not args.dry_run:
    # The library shares one pinned_host copy of the pool among the engines alive at once and
    # frees it with the last (issue 32); the stages make one engine at a time, so an engine of
    # no slots holds the copy for the run instead of each row copying the 9.7 GB pool again.
    try:
      import ftjax  # noqa: PLC0415
      holder = ftjax.Engine(model, cache_slots=0, policy="cpu_only", pool="pinned_host")
      run.results["pinned_pool_holder"] = holder.placement.description
    except Exception as e:  # noqa: BLE001 - the rows then make their own copies
      run.results["pinned_pool_holder"] = f"none: {type(e).__name__}: {e}"
  result = run.stage("decode", lambda: decode(model, prof, args, run), min_left_s=120)
  if result is not None:
    info = run.results["stages"].get("machine", {}).get("result") or {}
    title = (f"{info.get('devices', ['?'])[0]}, {args.layers}-layer Qwen3-30B-A3B shape"
             + (" (dry run on the CPU: not GPU numbers)" if args.dry_run else ""))
    run.results["plot"] = run.stage("plot", lambda: plot(result, title))
  run.stage("overlap", lambda: overlap(model, prof, args), min_left_s=30)
  run.stage("prefill", lambda: prefill(model, prof, args, run), min_left_s=60)
  del holder
  log(f"wrote {run.write()} ({time.perf_counter() - run.t0:.0f} s)")


if __name__ == "__main__":
  main()
