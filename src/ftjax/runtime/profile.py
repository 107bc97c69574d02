"""Bandwidth profile of this machine (DESIGN section 7), the numbers the q* rule runs on.

Measured, each as the median over alternating rounds (memory bandwidth on small machines
swings by up to 2x over seconds, so single numbers are not trusted):

* ``read_gb_s``: host read bandwidth, the ceiling (``ftjax_read_probe`` over a buffer much
  larger than the last-level cache, with the kernels' own threads);
* ``b_h_gb_s`` (B_H): the host expert kernel at batch 1 for the model's expert shape, with
  ``top_k`` experts per call rotating over a bank larger than the caches: expert bytes read
  per second;
* ``b_p_gb_s`` (B_P): the slot fill (``ftjax_slot_fill``) copying ``top_k`` experts per call
  from the host pool into cache slots: expert bytes moved per second. On the CPU backend the
  "device" cache is host memory too, so this is a memcpy; on a GPU host it is the
  host-to-device transfer;
* ``concurrent``: B_H and B_P again while both run at the same time (two threads), which is
  how decode uses them (DESIGN section 2 prefers this pair);
* ``host_grouped_gflops``: the host kernel's grouped (prefill) form, 64 tokens of ``top_k``
  experts each: multiply-add FLOPs per second. The engine weighs it against streaming whole
  layers in a long prefill (``ftjax.cache.streaming.prefill_stream_threshold``).

On a GPU backend the host kernel runs on the CPU device (the pool a host array) and B_P is the
fill into device slots: ``b_p_gb_s`` by the CUDA copy kernel reading the registered, mapped
pool (``ftjax.kernels.cuda.pool_fill``), ``b_p_slices_gb_s`` by XLA's in-program slices of a
``pinned_host`` pool (the ``pinned_host`` placement's fills), measured side by side.

The JSON profile is keyed by host, device and expert shape; ``load_profile`` checks the key.

Turning a measurement into the cost model's hardware profile (with overheads calibrated from a
short decode) is research tooling: ``ftjax.research.calibrate``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import statistics
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.cache.moe import Offload, fill_slots
from ftjax.formats import ftw
from ftjax.kernels import SWIGLU, ExpertVariant, cuda, expert_ffn, read_probe, slot_fill
from ftjax.utils import quant
from ftjax.utils.progress import Progress

PROFILE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ExpertShape:
  hidden: int  # D
  ffn: int  # F
  dtype: str  # the bank's expert format: bfloat16, float32, int8, int4 or mxfp4 (docs/ftw.md)
  top_k: int = 8
  # Whether the experts carry biases (gpt-oss's, after an mxfp4 block's scales). None: the
  # format's usual case, biases in mxfp4 blocks (gpt-oss, the family that ships MXFP4), none
  # elsewhere; left out of the profile's key then, so profiles written before it still match.
  bias: bool | None = None

  @property
  def has_bias(self) -> bool:
    return self.dtype == "mxfp4" if self.bias is None else self.bias

  @property
  def block_elems(self) -> int:
    return 3 * self.ffn * self.hidden

  @property
  def expert_bytes(self) -> int:
    """Bytes one expert's content takes (int8: weights and float32 row scales; mxfp4: codes,
    E8M0 scales and any float32 biases)."""
    if self.dtype == "int8":
      return quant.int8_block_bytes(self.ffn, self.hidden)
    if self.dtype == "mxfp4":
      return quant.mxfp4_block_bytes(self.ffn, self.hidden, self.has_bias)
    if self.dtype == "int4":
      return quant.int4_block_bytes(self.ffn, self.hidden)
    return self.block_elems * ftw.storage_dtype(self.dtype).itemsize


def expert_shape_bias(config, expert_format: str) -> bool | None:
  """``ExpertShape.bias`` for a model: None where the format's usual case holds (so the
  profile key stays the one written before the field existed), else the config's biases."""
  usual = expert_format == "mxfp4"
  return None if bool(config.expert_bias) == usual else bool(config.expert_bias)


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def _profile_key(shape: ExpertShape) -> dict[str, Any]:
  device = jax.devices()[0]
  return {"host": socket.gethostname(), "cpu": _cpu_model(), "platform": device.platform,
          "device": device.device_kind,
          "expert_shape": {k: v for k, v in dataclasses.asdict(shape).items()
                           if not (k == "bias" and v is None)}}


def synthetic_bank(shape: ExpertShape, min_bytes: int = 1 << 30, seed: int = 0):
  """A [1, E, P] bank of random weights, at least ``min_bytes`` (far beyond the caches): a jax
  array on the CPU backend, a host (numpy) array on an accelerator, as ``ftjax.load`` gives."""
  dtype = ftw.expert_storage_dtype(shape.dtype)
  block = ftw.align(shape.expert_bytes) // dtype.itemsize
  experts = max(shape.top_k * 4, -(-min_bytes // (block * dtype.itemsize)))
  rng = np.random.default_rng(seed)
  if shape.dtype == "int8":
    pool = rng.integers(-127, 128, 1 << 22).astype(np.int8)
  elif shape.dtype == "mxfp4":  # random codes; scales and biases set below
    pool = rng.integers(0, 256, 1 << 22).astype(np.uint8)
  elif shape.dtype == "int4":  # random codes and parameters; each row's steps set below
    pool = rng.integers(0, 1 << 16, 1 << 22).astype(np.uint16)
  else:
    pool = (0.02 * rng.standard_normal(1 << 22, np.float32)).astype(dtype)
  bank = np.resize(pool, experts * block).reshape(1, experts, block)  # writes every page
  if shape.dtype == "int8":  # every block's row scales (float32, docs/ftw.md)
    start = quant.int8_scales_offset(shape.ffn, shape.hidden)
    rows = 2 * shape.ffn + shape.hidden
    bank.view(np.uint8)[..., start:start + 4 * rows] = np.full(
        rows, 0.02 / 127, np.float32).view(np.uint8)
  if shape.dtype == "mxfp4":  # scales 2^-7 (weights up to ~0.05), zero biases (and padding)
    at = quant.mxfp4_offsets(shape.ffn, shape.hidden)
    bank[..., at["scales"]["gate"]:at["biases"]["gate"]] = 120
    bank[..., at["biases"]["gate"]:] = 0
  if shape.dtype == "int4":  # every row's steps d = dm = 2^-10 (weights up to ~0.1)
    raw = bank.view(np.uint8)
    at = quant.int4_offsets(shape.ffn, shape.hidden)["params"]
    steps = np.array([2.0 ** -10, 2.0 ** -10], "<f4").view(np.uint8)
    for part, (rows, n) in (("gate", (shape.ffn, shape.hidden)), ("up", (shape.ffn, shape.hidden)),
                            ("down", (shape.hidden, shape.ffn))):
      width = quant.int4_param_bytes(n)
      params = raw[..., at[part]:at[part] + rows * width].reshape(*raw.shape[:2], rows, width)
      params[..., :8] = steps
  return jax.device_put(bank) if jax.default_backend() == "cpu" else bank


def _variant(shape: ExpertShape) -> ExpertVariant:
  """The expert function to measure: gpt-oss's where the blocks hold its biases."""
  return ExpertVariant("clamped_swiglu", bias=True) if shape.has_bias else SWIGLU


def _median_rate(fn: Callable[[], Any], nbytes: int, calls: int) -> float:
  """Bytes per second of ``calls`` back-to-back calls of fn (each blocks until ready)."""
  t0 = time.perf_counter()
  for _ in range(calls):
    fn()
  return nbytes * calls / (time.perf_counter() - t0)


def _workloads(bank, shape: ExpertShape):
  """Returns (read_fn, expert_fn, fill_fn, extra, (grouped_fn, grouped_flops)): closures over
  rotating expert sets; ``extra`` maps more fill variants to measure by name (the GPU's
  slices); the grouped call and its FLOPs measure the host kernel's prefill form."""
  if jax.default_backend() != "cpu":
    return _gpu_workloads(bank, shape)
  num_experts = bank.shape[1]
  k = shape.top_k
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, shape.hidden), np.float32))
  weights = jnp.full((1, k), 1.0 / k, jnp.float32)
  sets = [jnp.asarray((np.arange(k) + i * k)[None] % num_experts, jnp.int32)
          for i in range(max(1, num_experts // k))]
  run_expert = jax.jit(lambda x, ids, w, b: expert_ffn(x, ids, w, b, 0, ffn_dim=shape.ffn,
                                                       variant=_variant(shape)))
  slots = jnp.zeros((2 * k, bank.shape[2]), bank.dtype)
  fill = jax.jit(slot_fill, donate_argnums=0)
  dst = jnp.arange(k, dtype=jnp.int32)
  srcs = [jnp.stack([jnp.zeros(k, jnp.int32), s[0]], axis=1) for s in sets]
  state = {"i": 0, "j": 0, "slots": slots}

  def expert_once():
    state["i"] = (state["i"] + 1) % len(sets)
    run_expert(x, sets[state["i"]], weights, bank).block_until_ready()

  def fill_once():
    state["j"] = (state["j"] + 1) % len(srcs)
    state["slots"] = fill(state["slots"], bank, srcs[state["j"]], dst)
    state["slots"].block_until_ready()

  def read_once():
    read_probe(bank).block_until_ready()

  grouped_once, flops = _grouped_workload(bank, shape)
  return read_once, expert_once, fill_once, {}, (grouped_once, flops)


_GROUPED_TOKENS = 64  # tokens of the grouped (prefill) measurement


def _grouped_workload(bank, shape: ExpertShape):
  """The host kernel in grouped form: 64 tokens, top_k random experts each; returns the call
  and its multiply-add FLOPs (2 per weight per route, three matrices)."""
  rng = np.random.default_rng(2)
  num_experts, k = bank.shape[1], shape.top_k
  ids = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(_GROUPED_TOKENS)])
  device = bank.devices().pop() if hasattr(bank, "devices") else jax.devices("cpu")[0]
  x, ids, weights = jax.device_put(
      (rng.standard_normal((_GROUPED_TOKENS, shape.hidden)).astype(np.float32),
       ids.astype(np.int32), np.full((_GROUPED_TOKENS, k), 1.0 / k, np.float32)), device)
  run = jax.jit(lambda x, ids, w, b: expert_ffn(x, ids, w, b, 0, ffn_dim=shape.ffn,
                                                variant=_variant(shape)))

  def grouped_once():
    run(x, ids, weights, bank).block_until_ready()

  return grouped_once, 2 * 3 * shape.ffn * shape.hidden * _GROUPED_TOKENS * k


def _gpu_workloads(bank, shape: ExpertShape):
  """The GPU host's workloads: the host kernel on the CPU device, fills into device slots."""
  host = np.ascontiguousarray(np.asarray(bank))
  cpu = jax.devices("cpu")[0]
  cpu_bank = jax.device_put(host, cpu)
  num_experts, k = host.shape[1], shape.top_k
  x = jax.device_put(np.random.default_rng(1).standard_normal((1, shape.hidden), np.float32), cpu)
  weights = jax.device_put(np.full((1, k), 1.0 / k, np.float32), cpu)
  sets = [(np.arange(k) + i * k)[None] % num_experts for i in range(max(1, num_experts // k))]
  cpu_sets = [jax.device_put(s.astype(np.int32), cpu) for s in sets]
  run_expert = jax.jit(lambda x, ids, w, b: expert_ffn(x, ids, w, b, 0, ffn_dim=shape.ffn,
                                                       variant=_variant(shape)))
  spec = cuda.register_pool(host)
  pinned = jax.device_put(host, jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                                  memory_kind="pinned_host"))
  kernel_fill = jax.jit(lambda s, src, dst: cuda.pool_fill(s, src, dst, pool=spec),
                        donate_argnums=0)
  slices_fill = jax.jit(lambda s, b, e, d: fill_slots(s, b, 0, e, d,
                                                      offload=Offload(fill="slices")),
                        donate_argnums=0)
  dst = jnp.arange(k, dtype=jnp.int32)
  experts = [jnp.asarray(s[0], jnp.int32) for s in sets]
  srcs = [jnp.stack([jnp.zeros(k, jnp.int32), e], axis=1) for e in experts]
  state = {"i": 0, "j": 0, "slots": jnp.zeros((2 * k, host.shape[2]), host.dtype)}

  def expert_once():
    state["i"] = (state["i"] + 1) % len(sets)
    run_expert(x, cpu_sets[state["i"]], weights, cpu_bank).block_until_ready()

  def fill_once():
    state["j"] = (state["j"] + 1) % len(srcs)
    state["slots"] = kernel_fill(state["slots"], srcs[state["j"]], dst)
    state["slots"].block_until_ready()

  def slices_once():
    state["j"] = (state["j"] + 1) % len(srcs)
    state["slots"] = slices_fill(state["slots"], pinned, experts[state["j"]], dst)
    state["slots"].block_until_ready()

  def read_once():
    read_probe(cpu_bank).block_until_ready()

  return (read_once, expert_once, fill_once, {"b_p_slices_gb_s": slices_once},
          _grouped_workload(cpu_bank, shape))


def measure(bank: jax.Array, shape: ExpertShape, *, rounds: int = 5, calls: int = 40,
            show_progress: bool = True) -> dict[str, Any]:
  """Runs the measurements; returns the profile dict (see the module docstring)."""
  read_once, expert_once, fill_once, extra, (grouped_once, grouped_flops) = _workloads(bank,
                                                                                      shape)
  bank_bytes = int(np.prod(bank.shape)) * np.dtype(bank.dtype).itemsize
  per_call = shape.top_k * shape.expert_bytes
  for fn in (read_once, expert_once, fill_once, grouped_once, *extra.values()):  # compile, warm
    fn()
  rows = []
  bar = Progress(rounds, desc="profile", enabled=show_progress)
  for _ in range(rounds):
    row = {"read_gb_s": _median_rate(read_once, bank_bytes, 2) / 1e9,
           "b_h_gb_s": _median_rate(expert_once, per_call, calls) / 1e9,
           "b_p_gb_s": _median_rate(fill_once, per_call, calls) / 1e9}
    row.update({name: _median_rate(fn, per_call, calls) / 1e9 for name, fn in extra.items()})
    row["host_grouped_gflops"] = _median_rate(grouped_once, grouped_flops,
                                              max(1, calls // 8)) / 1e9
    row.update(_concurrent(expert_once, fill_once, per_call, calls))
    rows.append(row)
    bar.update()
  bar.close()
  med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
  return {
      "version": PROFILE_VERSION, **_profile_key(shape),
      "read_gb_s": med["read_gb_s"], "b_h_gb_s": med["b_h_gb_s"], "b_p_gb_s": med["b_p_gb_s"],
      **{name: med[name] for name in extra},
      "host_grouped_gflops": med["host_grouped_gflops"],
      "concurrent": {"b_h_gb_s": med["concurrent_b_h_gb_s"],
                     "b_p_gb_s": med["concurrent_b_p_gb_s"]},
      "rounds": rows, "bank_bytes": bank_bytes,
      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }


def _concurrent(expert_once, fill_once, per_call: int, calls: int) -> dict[str, float]:
  """B_H and B_P while both run: two threads, each timing its own calls."""
  out: dict[str, float] = {}
  start = threading.Barrier(2)

  def run(name, fn):
    start.wait()
    out[name] = _median_rate(fn, per_call, calls) / 1e9

  threads = [threading.Thread(target=run, args=("concurrent_b_p_gb_s", fill_once))]
  threads[0].start()
  run("concurrent_b_h_gb_s", expert_once)
  threads[0].join()
  return out


def save_profile(profile: dict[str, Any], path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(profile, f, indent=1)
  return path


def load_profile(path: str, shape: ExpertShape | None = None) -> dict[str, Any]:
  """Reads a profile; with ``shape``, checks it was measured for that expert shape here."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"bandwidth profile {path} not found: write one with "
                            "`python -m ftjax.profile --out=PATH`")
  with open(path) as f:
    profile = json.load(f)
  if profile.get("version", 0) > PROFILE_VERSION:
    raise ValueError(f"{path} is a newer profile format ({profile.get('version')}); upgrade ftjax")
  if shape is not None:
    want = _profile_key(shape)
    for key in ("host", "platform", "expert_shape"):
      if profile.get(key) != want[key]:
        raise ValueError(f"profile {path} was measured for {key}={profile.get(key)!r}, not "
                         f"{want[key]!r}: run `python -m ftjax.profile` on this machine and model")
  return profile
