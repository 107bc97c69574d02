"""Decode cost model: the modeled time of decode steps from their per-layer cache counts.

A hardware profile (``HardwareProfile``: bandwidths and fixed costs of one machine) and a
model's shapes (``ModelShape``: expert and dense bytes) turn the counts that the engine
records per step and layer (``Engine.stats()["per_step"]``: distinct experts hit, filled and
run on the host) or that a trace replay produces into seconds. Pure numpy: it runs anywhere,
for any model and machine, without weights or an accelerator (``prefetch_room``, the same
formula inside a replay's scan, runs it in jax.numpy).

One MoE layer-step (``layer_step_time``), with S the bytes of one expert, 1 GB = 1e9 bytes,
``dma = fills·S / B_P`` and ``B_res = B_H − B_P``::

  device = max((hits + fills)·S / device_bw,                # slot experts' compute
               dma + [fills > 0]·S / device_bw)             # ... the last fill lands first
  host   = min(host_runs·S / B_res,                         # all read while the DMA runs
               dma + (host_runs·S − dma·B_res) / B_H)       # or the rest at B_H after it
  t = max(device, host) + dense_bytes_per_layer / device_bw + layer_overhead_s

One decode step (``step_times``) is the sum over the MoE layers plus
``head_bytes / device_bw + step_overhead_s``; ``modeled_tok_s`` is 1 / mean step time.

Assumptions (the FreeToken model, DESIGN section 2): decode at batch 1 is memory-bound, so
every term is bytes over a bandwidth. The host kernel and the fills' DMA share host memory:
while the DMA runs it takes B_P of it and the host kernel reads at B_res = B_H − B_P, after
it at B_H (the ``min`` above is that piecewise time in closed form: the first term when the
host finishes before the DMA, the second otherwise; with B_P >= B_H the host reads nothing
while the DMA runs). This is the model q* is derived from: ``q/B_P = (m − q)/B_res`` gives
``q* = m·B_P/B_H``, and for every ``q <= q*`` the host path takes ``m·S/B_H``, exactly the
time of running all ``m`` misses on the host, so fills up to q* are free warm-up of the cache
and each fill past q* costs S/B_P. The host term is ``ftjax.cache.streaming.host_read_time``,
the one contention formula that the prefill cost model (``prefill_layer_times`` there) uses
too. On the device, fills land one after the other on the copy engine
while the compute units run the resident experts, so the slot compute hides under the copies
except for the expert that lands last (its compute, S/device_bw, follows its copy).
Not modelled: the KV cache and recurrent-state reads (they grow with the context or are
small at short context), and compute-bound work (prefill).

Hand-worked cases are in ``tests/test_cost.py``; ``test_q_star_minimises_the_layer_step``
checks, for m = 1..16 misses on every profile in ``configs/hardware``, that the q* rule's
fill count gives the least modelled layer-step time over every integer q, up to the two
exceptions the model implies: q* rounded up (``fill_count`` rounds 1.5 to 2, as the paper
does, to warm the cache) costs (ceil(q*) − q*)·S/B_P more than the floor in that step, and
when q* is within B_P/device_bw of an integer the last landed fill's compute (S/device_bw)
makes one fill fewer better by at most that much.

On a CPU-only machine the "device" is the host itself: slot compute, fills and the host
kernel share the same cores and memory bus and run one after the other, and ``device_bw`` is
the host's read bandwidth. Such profiles set ``paths_overlap: false``: then the layer-step
is the sum ``dma + (hits + fills)·S/device_bw + host_runs·S/B_H`` (nothing runs at the same
time, so nothing contends; ``python -m ftjax.profile --hardware_out`` writes false).
``benchmarks/cost_model.py`` measures the model against the engine there: modeled / measured
step time 0.96-1.03 on a 2-core VM with the paths added, 0.86-1.01 if they were assumed to
overlap (measured before the contention model; the added paths, which CPU profiles use, are
unchanged by it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
import yaml

from ftjax.cache.streaming import host_read_time
from ftjax.model.config import ModelConfig
from ftjax.utils import quant

GB = 1e9  # bandwidths are in GB/s of 1e9 bytes, as vendors and the paper quote them

# Bytes per parameter of the dtypes found in checkpoints' config.json.
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


# -- Hardware -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """One machine's numbers for the cost model (``configs/hardware/*.yaml``).

  name: a short label (plots and tables).
  b_p: GB/s of host-to-device copies, i.e. cache fills (B_P).
  b_h: GB/s of expert weights read by the host expert kernel at batch 1 (B_H).
  device_bw: GB/s the device reads its memory at (slot experts, dense weights, lm_head).
  layer_overhead_s: seconds of fixed cost per MoE layer-step: kernel launches, attention
    and router math for one token, the host/device synchronisation of the split.
  step_overhead_s: seconds of fixed cost per decoded token: embedding, sampling, the host
    loop.
  device_memory_gb: GB (1e9 bytes) of device memory, for sizing the cache.
  source: where the numbers come from (measured, paper, vendor spec, assumed).
  paths_overlap: optional, default true: the device path (fills, then slot compute) and the
    host kernel run at the same time, so a layer-step costs the slower one (a GPU machine).
    False adds them (a CPU-only machine, where one set of cores runs both: measured by
    ``benchmarks/cost_model.py``); ``python -m ftjax.profile --hardware_out`` writes false.

  Bandwidths and memory must be positive; overheads may be zero (none) but not negative.
  """
  name: str
  b_p: float
  b_h: float
  device_bw: float
  layer_overhead_s: float
  step_overhead_s: float
  device_memory_gb: float
  source: str
  paths_overlap: bool = True

  _POSITIVE = ("b_p", "b_h", "device_bw", "device_memory_gb")
  _NON_NEGATIVE = ("layer_overhead_s", "step_overhead_s")

  def __post_init__(self):
    for key in ("name", "source"):
      value = getattr(self, key)
      if not isinstance(value, str) or not value.strip():
        raise ValueError(f"hardware profile key {key!r} must be a non-empty string, got "
                         f"{value!r}")
    if not isinstance(self.paths_overlap, bool):
      raise ValueError(f"hardware profile key 'paths_overlap' must be true or false, got "
                       f"{self.paths_overlap!r}")
    for key in self._POSITIVE + self._NON_NEGATIVE:
      value = getattr(self, key)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"hardware profile key {key!r} must be a number, got {value!r}")
      if key in self._POSITIVE and value <= 0:
        raise ValueError(f"hardware profile key {key!r} must be positive, got {value!r}")
      if value < 0:
        raise ValueError(f"hardware profile key {key!r} must be >= 0, got {value!r}")
      object.__setattr__(self, key, float(value))

  @classmethod
  def keys(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any], where: str = "hardware profile") -> "HardwareProfile":
    """Validates ``d``; errors name ``where`` (the file), the key and the fix."""
    if not isinstance(d, dict):
      raise ValueError(f"{where}: expected a mapping of {', '.join(cls.keys())}, got "
                       f"{type(d).__name__}")
    unknown = sorted(set(d) - set(cls.keys()))
    if unknown:
      raise ValueError(f"{where}: unknown key(s) {unknown}: remove them or fix their spelling; "
                       f"the keys are {', '.join(cls.keys())}")
    missing = [k for k in cls.keys() if k not in d and k != "paths_overlap"]
    if missing:
      raise ValueError(f"{where}: missing key(s) {missing}: add them (see "
                       "configs/hardware/README.md for their units)")
    try:
      return cls(**d)
    except ValueError as e:
      raise ValueError(f"{where}: {e}: fix the value (see configs/hardware/README.md)") from None

  @classmethod
  def load(cls, path: str | os.PathLike) -> "HardwareProfile":
    """Reads a YAML hardware profile (``configs/hardware/*.yaml``)."""
    d = _read_config(path, "YAML", yaml.safe_load, yaml.YAMLError,
                     f"hardware profile {path} not found: pick one in configs/hardware/ or write "
                     "this machine's with `python -m ftjax.profile --hardware_out=PATH`")
    return cls.from_dict(d, where=str(path))

  def save(self, path: str | os.PathLike) -> str:
    """Writes the profile as YAML (the format ``load`` reads)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      yaml.safe_dump(self.to_dict(), f, sort_keys=False, width=100)
    return str(path)


def _read_config(path: str | os.PathLike, fmt: str, parse, syntax_error: type[Exception],
                 not_found: str) -> Any:
  """Parses a config file; a missing file or bad syntax is an error that names the file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(not_found)
  with open(path) as f:
    try:
      return parse(f)
    except syntax_error as e:
      raise ValueError(f"{path}: not valid {fmt} ({e}): fix the syntax") from None


# -- Model shapes ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """The bytes a decode step of one model reads, per part (no weights needed).

  num_layers: MoE layers L. num_experts: routed experts per layer E. top_k: K.
  hidden: D. expert_ffn: F, the width of one routed expert.
  bytes_per_param: 2 for bfloat16 (the dense weights, and the experts unless quantised).
  dense_bytes_per_layer: bytes of a layer's non-expert weights read per decoded token
    (attention or linear-attention mixer, router, shared expert, norms), the mean over the
    layers when they differ (hybrid models).
  head_bytes: bytes read once per token outside the layers: the embedding row, the final
    norm and the lm_head.
  expert_bias: each routed expert also has gate [F], up [F] and down [D] biases (gpt-oss).
  """
  name: str
  num_layers: int
  num_experts: int
  top_k: int
  hidden: int
  expert_ffn: int
  bytes_per_param: int
  dense_bytes_per_layer: float
  head_bytes: float
  expert_bias: bool = False
  # The routed experts' quantised format, "int8" (int8 weights and float32 row scales) or
  # "mxfp4" (gpt-oss's MXFP4 codes, E8M0 scales and float32 biases; docs/ftw.md); None: experts of bytes_per_param bytes a weight, like the dense weights.
  expert_format: str | None = None

  def __post_init__(self):
    for key in ("num_layers", "num_experts", "top_k", "hidden", "expert_ffn", "bytes_per_param"):
      if int(getattr(self, key)) <= 0:
        raise ValueError(f"model shape {self.name!r}: {key} must be positive, got "
                         f"{getattr(self, key)}")
    if self.top_k > self.num_experts:
      raise ValueError(f"model shape {self.name!r}: top_k={self.top_k} exceeds num_experts="
                       f"{self.num_experts}")
    if self.expert_format not in (None, *quant.QUANTISED_EXPERT_FORMATS):
      raise ValueError(f"model shape {self.name!r}: expert_format must be one of "
                       f"{quant.QUANTISED_EXPERT_FORMATS} or None, got {self.expert_format!r}")
    if self.dense_bytes_per_layer < 0 or self.head_bytes < 0:
      raise ValueError(f"model shape {self.name!r}: dense_bytes_per_layer and head_bytes must be "
                       ">= 0")

  @property
  def expert_bytes(self) -> int:
    """Bytes of one routed expert: gate [F, D], up [F, D], down [D, F] (and with
    ``expert_bias`` their biases [F], [F], [D]; int8: plus their float32 row scales; mxfp4:
    4-bit codes, an E8M0 scale per 32 inputs and with ``expert_bias`` float32 biases)."""
    if self.expert_format == "int8":
      return quant.int8_block_bytes(self.expert_ffn, self.hidden)
    if self.expert_format == "mxfp4":
      return quant.mxfp4_block_bytes(self.expert_ffn, self.hidden, self.expert_bias)
    if self.expert_format == "int4":
      return quant.int4_block_bytes(self.expert_ffn, self.hidden)
    bias = 2 * self.expert_ffn + self.hidden if self.expert_bias else 0
    return (3 * self.hidden * self.expert_ffn + bias) * self.bytes_per_param

  @property
  def total_experts(self) -> int:
    return self.num_layers * self.num_experts

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_config(cls, config, name: str | None = None, bytes_per_param: int | None = None,
                  expert_format: str | None = None) -> "ModelShape":
    """From ftjax's ``ModelConfig``.

    ``bytes_per_param`` defaults to the checkpoint dtype's (``config.source_dtype``);
    ``expert_format``: the routed experts' quantised format (``"int8"``, ``"mxfp4"``), if any; a float
    format name means no quantisation (None). Hybrid
    models (Gated DeltaNet ``linear_attention`` layers between attention layers) get the
    mean of their layers' mixers; see ``_gated_deltanet_params`` for the linear mixer.
    """
    c = config
    nbytes = bytes_per_param or _dtype_bytes(c.source_dtype, name or c.model_type)
    attention = _attention_params(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                  q_gate=c.attn_output_gate, qkv_bias=c.qkv_bias,
                                  o_bias=c.o_bias, qk_norm=c.qk_norm, sinks=c.attn_sinks)
    if c.latent_attention:
      attention = _latent_attention_params(c)
    mixers = {"full_attention": attention, "sliding_attention": attention}
    if "linear_attention" in c.layer_types:
      mixers["linear_attention"] = _gated_deltanet_params(
          c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads,
          c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel)
    moe = _moe_block_params(c.hidden_size, c.num_experts, c.shared_expert_intermediate_size,
                            c.shared_expert_gate, router_bias=c.router_bias)
    # Dense MLP layers (``dense_layers``: the MLP and the layer's two RMSNorms) are dense
    # weights; the shape's layers are the MoE layers, each with an equal share of the dense.
    moe_layers = c.num_decoder_moe_layers
    dense_mlp = len(c.dense_layers) * (3 * c.dense_intermediate_size + 2) * c.hidden_size
    mixer = sum(mixers[t] for t in c.layer_types) / moe_layers + dense_mlp / moe_layers
    return cls(name=name or c.model_type, num_layers=moe_layers, num_experts=c.num_experts,
               top_k=c.top_k, hidden=c.hidden_size, expert_ffn=c.moe_intermediate_size,
               bytes_per_param=nbytes, dense_bytes_per_layer=float((mixer + moe) * nbytes),
               head_bytes=float(_head_params(c.hidden_size, c.vocab_size) * nbytes),
               expert_bias=c.expert_bias,
               expert_format=expert_format if expert_format in quant.QUANTISED_EXPERT_FORMATS
               else None)

  @classmethod
  def from_hf_config(cls, hf: dict[str, Any], name: str | None = None,
                     bytes_per_param: int | None = None) -> "ModelShape":
    """From a Hugging Face ``config.json`` dict, through ``ModelConfig.from_hf_config`` (one
    parser for every family, hybrid and composite vision-language configs included)."""
    name = name or hf.get("_name_or_path") or hf.get("model_type")
    return cls.from_config(ModelConfig.from_hf_config(hf), name=name,
                           bytes_per_param=bytes_per_param)

  @classmethod
  def load(cls, path: str | os.PathLike, bytes_per_param: int | None = None) -> "ModelShape":
    """Reads a ``config.json``-style file (``configs/models/*.json``); named by its file."""
    hf = _read_config(path, "JSON", json.load, json.JSONDecodeError,
                      f"model config {path} not found: pick one in configs/models/ or give a "
                      "checkpoint's config.json")
    name = os.path.splitext(os.path.basename(path))[0]
    try:
      return cls.from_hf_config(hf, name=name, bytes_per_param=bytes_per_param)
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{path}: cannot compute the model's shapes: {e}") from None


def _dtype_bytes(dtype: str | None, name: str) -> int:
  if dtype is None:
    return 2  # checkpoints without a dtype key are served in bfloat16
  if dtype not in _DTYPE_BYTES:
    raise ValueError(f"{name}: unknown dtype {dtype!r} (known: {', '.join(_DTYPE_BYTES)}); pass "
                     "bytes_per_param= explicitly")
  return _DTYPE_BYTES[dtype]


def _attention_params(d: int, heads: int, kv_heads: int, head_dim: int, *, q_gate: bool = False,
                      qkv_bias: bool = False, o_bias: bool = False, qk_norm: str | None = None,
                      sinks: bool = False) -> int:
  """Parameters of one attention block: q (doubled by an output gate), k, v, o and their
  biases, q/k norms, attention sinks."""
  q, kv = heads * head_dim * (2 if q_gate else 1), kv_heads * head_dim
  n = d * (q + 2 * kv) + heads * head_dim * d
  if qkv_bias:
    n += q + 2 * kv
  if o_bias:
    n += d
  if qk_norm == "per_head":
    n += 2 * head_dim
  elif qk_norm == "full":
    n += heads * head_dim + kv
  return n + (heads if sinks else 0)


def _latent_attention_params(c) -> int:
  """Parameters of one multi-head latent attention block (``LatentAttention``): the query
  projections (through the normed rank-Q bottleneck, or one), the latent's projection and
  norm, the per-head key/value expansion [H, N + V, R] and the output projection."""
  h, d, r = c.num_heads, c.hidden_size, c.kv_lora_rank
  width = c.qk_nope_head_dim + c.head_dim
  q = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * width if c.q_lora_rank else (
      d * h * width)
  return q + d * (r + c.head_dim) + r + r * h * (c.qk_nope_head_dim + c.v_head_dim) + (
      h * c.v_head_dim * d)


def _moe_block_params(d: int, num_experts: int, shared_ffn: int, shared_gate: bool, *,
                      router_bias: bool = False) -> int:
  """Non-routed parameters of one MoE layer besides its mixer: router [E, D] (and its bias
  [E]), shared expert (SwiGLU of width I, plus its sigmoid gate [1, D]) and the layer's two
  RMSNorms."""
  n = num_experts * d + 2 * d + (num_experts if router_bias else 0)
  if shared_ffn:
    n += 3 * d * shared_ffn + (d if shared_gate else 0)
  return n


def _head_params(d: int, vocab: int) -> int:
  """Embedding row, final norm and lm_head, read once per token (a tied lm_head is read too)."""
  return d + d + vocab * d


def _gated_deltanet_params(d: int, key_heads: int, value_heads: int, key_dim: int,
                           value_dim: int, conv_width: int) -> int:
  """Parameters of one Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 ``linear_attn``).

  With key_all = key_heads · key_dim, value_all = value_heads · value_dim, Hv = value_heads
  and conv_dim = 2·key_all + value_all:

    D·(2·key_all + value_all)      in_proj_qkv   (Qwen3-Next fuses qkv and z as in_proj_qkvz,
    + D·value_all                  in_proj_z      and b and a as in_proj_ba: same count)
    + 2·D·Hv                       in_proj_b, in_proj_a
    + conv_dim·conv_width          depthwise causal conv1d, no bias
    + value_all·D                  out_proj
    + 2·Hv + value_dim             dt_bias, A_log, the gated RMSNorm

  Qwen3.5-35B-A3B (D 2048, 16 key / 32 value heads of 128, kernel 4): 33,718,464 parameters,
  67.4 MB in bfloat16. The recurrent state ([Hv, 128, 128] float32, 2.1 MB per layer) is
  read and written every token but is state, not weights, and is not counted.
  """
  key_all, value_all = key_heads * key_dim, value_heads * value_dim
  conv_dim = 2 * key_all + value_all
  return (d * (conv_dim + value_all + 2 * value_heads) + conv_dim * conv_width
          + value_all * d + 2 * value_heads + value_dim)


# -- The model ------------------------------------------------------------------------------


def layer_step_time(hw: HardwareProfile, shape: ModelShape, hits, fills, host_runs,
                    prefetches=None) -> np.ndarray:
  """Seconds of each MoE layer-step, elementwise over equal-shaped count arrays.

  hits, fills, host_runs: distinct experts of the layer-step served from a slot, copied into
  a slot and then served from it, and run by the host kernel from the pool (e.g. [steps,
  layers], as ``Engine.stats()["per_step"]`` or a trace replay gives them).

  With S = ``shape.expert_bytes``, dma = fills·S/B_P and B_res = B_H − B_P (the module
  docstring has the reasoning)::

    device = max((hits + fills)·S/device_bw, dma + [fills > 0]·S/device_bw)
    host   = min(host_runs·S/B_res, dma + (host_runs·S − dma·B_res)/B_H)
    max(device, host) + dense_bytes_per_layer/device_bw + layer_overhead_s

  ``host`` is ``ftjax.cache.streaming.host_read_time``, the contention formula the prefill
  cost model shares.

  ``prefetches`` (same shape, optional): experts the layer-step prefetched for the next one
  (``ftjax.research.replay.Prefetch``). Their copies follow the step's own fills on the link
  and must land within the step, whose dense part they may overlap: with link = dma +
  prefetches·S/B_P the step takes max(the time above, link), and the host kernel shares
  memory with the DMA for all of link. A prefetch is charged where it is made; the step that
  uses it counts a hit.

  When ``hw.paths_overlap`` is false (a CPU-only machine, one set of cores for both paths)
  the paths run one after the other and do not contend:
  ``dma + (hits + fills)·S/device_bw + host_runs·S/B_H`` replaces the max.
  """
  hits, fills, host_runs = _counts(hits, fills, host_runs)
  prefetches = (np.zeros_like(fills) if prefetches is None
                else _counts(prefetches, prefetches, prefetches)[0])
  return _layer_seconds(np, hw, shape, hits, fills, host_runs, prefetches)


def _layer_seconds(xp, hw: HardwareProfile, shape: ModelShape, hits, fills, host_runs,
                   prefetches):
  """``layer_step_time``'s formula in the array module ``xp`` (numpy, or jax.numpy inside a
  replay's scan)."""
  s = shape.expert_bytes
  b_p, b_h, device_bw = hw.b_p * GB, hw.b_h * GB, hw.device_bw * GB
  dma = fills * s / b_p
  link = dma + prefetches * s / b_p
  compute = (hits + fills) * s / device_bw
  rest = shape.dense_bytes_per_layer / device_bw + hw.layer_overhead_s
  if not hw.paths_overlap:
    return link + compute + host_runs * s / b_h + rest
  device = xp.maximum(compute, dma + (fills > 0) * (s / device_bw))
  host = host_read_time(host_runs * s, link, b_p, b_h)
  # A prefetch's copies follow the step's own fills and may run through the whole step
  # (its dense part too), not only under its experts.
  return xp.maximum(xp.maximum(device, host) + rest, link)


def prefetch_room(hw: HardwareProfile, shape: ModelShape, hits, fills, host_runs,
                  most: int):
  """How many experts (up to ``most``) a layer-step can prefetch in its link's idle time: the
  copies of S bytes at B_P that fit in the step's modeled time (``layer_step_time`` without
  prefetch) after its own fills, for scalar jax counts (a replay's scan; a jax int32). 0 where
  the paths do not overlap (``paths_overlap: false``: on a CPU a copy is work of the same
  cores). The copies still share host memory with the host kernel: ``layer_step_time`` with
  ``prefetches`` charges that contention where the step runs experts on the host."""
  if not hw.paths_overlap:
    return jnp.zeros((), jnp.int32)
  f32 = jnp.float32
  fills = jnp.asarray(fills, f32)
  seconds = _layer_seconds(jnp, hw, shape, jnp.asarray(hits, f32), fills,
                           jnp.asarray(host_runs, f32), jnp.zeros((), f32))
  per_copy = shape.expert_bytes / (hw.b_p * GB)
  idle = jnp.maximum(seconds - fills * per_copy, 0.0)
  return jnp.clip(jnp.floor(idle / per_copy), 0, most).astype(jnp.int32)


def step_times(hw: HardwareProfile, shape: ModelShape, hits, fills, host_runs,
               prefetches=None) -> np.ndarray:
  """Seconds of each decode step: counts [..., layers] -> [...] (e.g. [steps, L] -> [steps]).

  The sum of ``layer_step_time`` over the last axis, which must hold all ``shape.num_layers``
  layers, plus ``head_bytes / device_bw + step_overhead_s``.
  """
  hits, fills, host_runs = _counts(hits, fills, host_runs)
  if hits.ndim == 0 or hits.shape[-1] != shape.num_layers:
    raise ValueError(f"counts must end in the layer axis of {shape.num_layers} layers "
                     f"({shape.name}), got shape {hits.shape}: pass [steps, layers], or model "
                     "the trace's depth with dataclasses.replace(shape, num_layers=...)")
  layers = layer_step_time(hw, shape, hits, fills, host_runs, prefetches).sum(axis=-1)
  return layers + shape.head_bytes / (hw.device_bw * GB) + hw.step_overhead_s


def modeled_tok_s(hw: HardwareProfile, shape: ModelShape, hits, fills, host_runs,
                  prefetches=None) -> float:
  """Decode tokens per second: 1 / the mean of ``step_times`` over all steps."""
  return float(1.0 / np.mean(step_times(hw, shape, hits, fills, host_runs, prefetches)))


def _counts(hits, fills, host_runs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  arrays = tuple(np.asarray(a, np.float64) for a in (hits, fills, host_runs))
  if not arrays[0].shape == arrays[1].shape == arrays[2].shape:
    raise ValueError(f"hits, fills and host_runs must have equal shapes, got "
                     f"{[a.shape for a in arrays]}")
  if any((a < 0).any() for a in arrays):
    raise ValueError("expert counts must be >= 0")
  return arrays
