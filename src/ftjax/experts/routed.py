"""The routed-expert math, in one place below both ``ftjax.model`` and ``ftjax.cache``.

The bank is one array ``[L, E, P]`` (see ``ftjax.formats.ftw``): block ``bank[l, e]`` holds
``gate [F, D]`` at element 0, ``up [F, D]`` at ``F·D`` and ``down [D, F]`` at ``2·F·D``;
with biases (``ExpertVariant.bias``, gpt-oss) the gate bias ``[F]`` follows at ``3·F·D``, the
up bias ``[F]`` at ``3·F·D + F`` and the down bias ``[D]`` at ``3·F·D + 2·F``, in the bank's
dtype; the tail up to ``P`` is alignment padding. An int8 bank (``ftjax.utils.quant``) holds the
int8 weights at those offsets (one byte each) and the float32 scales of their rows after them
(int8 blocks have no biases); the XLA path dequantises its blocks to float32 (``scale · q``).
An mxfp4 bank (uint8, MXFP4 as gpt-oss ships it: ``ftjax.utils.quant``) holds E2M1 codes, E8M0
scales per 32 inputs and, with biases, float32 biases; the XLA path dequantises it to float32
too (exact). An int4 bank (uint16 words) holds 4-bit codes and each row's parameters (a scale
and a min per 32 inputs); the XLA path dequantises it to its float32 weights (exact).
The ``ExpertVariant`` also names the activation: ``swiglu`` (``silu(g) · u``) or gpt-oss's
``clamped_swiglu`` (``(clip(u, ±limit) + 1) · g' · sigmoid(alpha · g')`` with
``g' = min(g, limit)``). ``routed_experts`` computes the weighted sum of
the routed experts of one layer of such a bank (the cache runs it on its slot buffer too, as
a one-layer bank of slots). ``BankExperts`` is the reference routed-experts function of the
model protocol (``ftjax.model.moe.RoutedExperts``): every routed expert read from the host
bank, no device cache. Two implementations compute the same sum:

* ``xla``: plain jnp. Few routes (decode): gather the routed blocks. Many routes (prefill):
  scan over experts with per-token combine weights, so memory stays ``O(T·F)``.
* ``ffi``: the host kernel ``ftjax_expert_ffn`` (CPU backend only); ``ffi_bf16`` rounds the
  activations to bfloat16 for bfloat16 banks (faster grouped prefill, ~1e-2 relative error);
  ``ffi_int8`` quantises them to int8 for int8 banks (vpdpbusd on AVX-512-VNNI CPUs: the
  opt-in that lifts int8 decode past the float32 widening's instruction rate, ~1e-2 relative
  error) and, in decode steps, for mxfp4 banks (per block of 32, as llama.cpp's Q8_0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ftjax.kernels import SWIGLU, ExpertVariant, expert_ffn
from ftjax.utils.arrays import take
from ftjax.utils.dense_quant import QuantizedMatrix
from ftjax.utils.quant import (E2M1_VALUES, MXFP4_BLOCK, int4_offsets, int4_param_bytes,
                               int8_scales_offset, mxfp4_offsets)

KERNELS = ("xla", "ffi", "ffi_bf16", "ffi_int8")  # the host-work implementations a step can run with


def split_block(block: jax.Array, ffn_dim: int, width: int):
  """[..., P] -> gate [..., F, D], up [..., F, D], down [..., D, F]: views in the bank's dtype,
  or for an int8 bank the dequantised float32 weights ``scale · q`` (int4, mxfp4: theirs)."""
  if block.dtype == jnp.uint8:
    return _split_mxfp4(block, ffn_dim, width)
  if block.dtype == jnp.uint16:
    return _split_int4(block, ffn_dim, width)
  fd = ffn_dim * width
  lead = block.shape[:-1]
  gate = block[..., :fd].reshape(*lead, ffn_dim, width)
  up = block[..., fd:2 * fd].reshape(*lead, ffn_dim, width)
  down = block[..., 2 * fd:3 * fd].reshape(*lead, width, ffn_dim)
  if block.dtype != jnp.int8:
    return gate, up, down
  start = int8_scales_offset(ffn_dim, width)
  count = 2 * ffn_dim + width
  scale_bytes = block[..., start:start + 4 * count].reshape(*lead, count, 4)
  scales = jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)  # [..., 2F + D]
  return (gate.astype(jnp.float32) * scales[..., :ffn_dim, None],
          up.astype(jnp.float32) * scales[..., ffn_dim:2 * ffn_dim, None],
          down.astype(jnp.float32) * scales[..., 2 * ffn_dim:, None])


def _split_mxfp4(block: jax.Array, ffn_dim: int, width: int):
  """The float32 weights ``E2M1[code] · 2**(e - 127)`` of an mxfp4 block [..., P] (uint8)."""
  at = mxfp4_offsets(ffn_dim, width)
  lead = block.shape[:-1]
  lut = jnp.asarray(E2M1_VALUES)
  out = []
  for part, (rows, cols) in (("gate", (ffn_dim, width)), ("up", (ffn_dim, width)),
                             ("down", (width, ffn_dim))):
    codes = block[..., at["codes"][part]:at["codes"][part] + rows * cols // 2]
    codes = codes.reshape(*lead, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2)
    values = jnp.stack([lut[codes & 15], lut[codes >> 4]], axis=-1)  # [..., R, G, 16, 2]
    start = at["scales"][part]
    exponent = block[..., start:start + rows * cols // MXFP4_BLOCK].reshape(
        *lead, rows, cols // MXFP4_BLOCK).astype(jnp.int32) - 127
    scale = jnp.ldexp(jnp.float32(1), exponent)  # [..., R, G]
    out.append((values * scale[..., None, None]).reshape(*lead, rows, cols))
  return tuple(out)


def _split_int4(block: jax.Array, ffn_dim: int, width: int):
  """The float32 weights ``d·s·q + dm·m`` of an int4 block [..., P] (uint16 words; exact, as
  ``QuantizedMatrix.dequantize``)."""
  lead = block.shape[:-1]
  raw = jax.lax.bitcast_convert_type(block, jnp.uint8).reshape(*lead, 2 * block.shape[-1])
  at = int4_offsets(ffn_dim, width)
  out = []
  for part, (rows, cols) in (("gate", (ffn_dim, width)), ("up", (ffn_dim, width)),
                             ("down", (width, ffn_dim))):
    c0, p0, pb = at["codes"][part], at["params"][part], int4_param_bytes(cols)
    codes = raw[..., c0:c0 + rows * cols // 2].reshape(*lead, rows, cols // 2)
    params = raw[..., p0:p0 + rows * pb].reshape(*lead, rows, pb)
    out.append(QuantizedMatrix(codes, params, "int4", (*lead, rows, cols), len(lead) + 1)
               .dequantize())
  return tuple(out)


def split_biases(block: jax.Array, ffn_dim: int, width: int):
  """[..., P] -> the biases of gate [..., F], up [..., F] and down [..., D] (float32) of a
  block with biases."""
  if block.dtype == jnp.uint8:  # mxfp4: float32 biases after the scales
    lead = block.shape[:-1]
    at = mxfp4_offsets(ffn_dim, width)["biases"]
    return tuple(jax.lax.bitcast_convert_type(
        block[..., at[p]:at[p] + 4 * n].reshape(*lead, n, 4), jnp.float32)
        for p, n in (("gate", ffn_dim), ("up", ffn_dim), ("down", width)))
  start = 3 * ffn_dim * width
  gate = block[..., start:start + ffn_dim]
  up = block[..., start + ffn_dim:start + 2 * ffn_dim]
  down = block[..., start + 2 * ffn_dim:start + 2 * ffn_dim + width]
  return tuple(b.astype(jnp.float32) for b in (gate, up, down))


def activate(g: jax.Array, u: jax.Array, variant: ExpertVariant) -> jax.Array:
  """The hidden activations h from the gate and up projections (biases added)."""
  if variant.activation == "clamped_swiglu":
    g = jnp.minimum(g, variant.limit)
    u = jnp.clip(u, -variant.limit, variant.limit)
    return (u + 1.0) * (g * jax.nn.sigmoid(variant.alpha * g))
  return jax.nn.silu(g) * u


def _routed_gather(x, ids, weights, bank_ep, ffn_dim, variant):
  """Few routes: gather each routed block. x [T, D], ids/weights [T, K]."""
  width = x.shape[-1]
  valid = ids >= 0
  blocks = take(bank_ep, jnp.where(valid, ids, 0))  # [T, K, P]
  gate, up, down = split_block(blocks, ffn_dim, width)
  gate, up, down = (w.astype(jnp.float32) for w in (gate, up, down))
  g = jnp.einsum("TD,TKFD->TKF", x, gate)
  u = jnp.einsum("TD,TKFD->TKF", x, up)
  w = jnp.where(valid, weights, 0.0)
  if not variant.bias:
    return jnp.einsum("TKF,TKDF,TK->TD", activate(g, u, variant), down, w)
  b_gate, b_up, b_down = split_biases(blocks, ffn_dim, width)  # [T, K, F], [T, K, F], [T, K, D]
  h = activate(g + b_gate, u + b_up, variant)
  z = jnp.einsum("TKF,TKDF->TKD", h, down) + b_down
  return jnp.einsum("TKD,TK->TD", z, w)


def _routed_scan(x, ids, weights, bank_ep, ffn_dim, variant):
  """Many routes: one pass per expert over all tokens, with per-token combine weights."""
  num_experts = bank_ep.shape[0]
  width = x.shape[-1]
  # combine[e, t] = sum_k weights[t, k] * (ids[t, k] == e)
  onehot = ids[None, :, :] == jnp.arange(num_experts, dtype=ids.dtype)[:, None, None]  # [E, T, K]
  combine = jnp.sum(jnp.where(onehot, weights[None], 0.0), axis=-1)  # [E, T]

  def one_expert(y, inputs):
    block, comb = inputs
    gate, up, down = (w.astype(jnp.float32) for w in split_block(block, ffn_dim, width))
    g, u = jnp.einsum("TD,FD->TF", x, gate), jnp.einsum("TD,FD->TF", x, up)
    if not variant.bias:
      return y + jnp.einsum("TF,DF,T->TD", activate(g, u, variant), down, comb), None
    b_gate, b_up, b_down = split_biases(block, ffn_dim, width)
    z = jnp.einsum("TF,DF->TD", activate(g + b_gate, u + b_up, variant), down) + b_down
    return y + z * comb[:, None], None

  y, _ = jax.lax.scan(one_expert, jnp.zeros_like(x), (bank_ep, combine))
  return y


def routed_experts(x: jax.Array, ids: jax.Array, weights: jax.Array, bank: jax.Array,
                   layer: int, *, ffn_dim: int, kernels: str = "xla",
                   variant: ExpertVariant = SWIGLU) -> jax.Array:
  """``sum_k weights[t,k] · expert_{ids[t,k]}(x[t])`` over layer ``layer`` of ``bank``.

  x [T, D] float32, ids [T, K] int32 (-1 = no route), weights [T, K] float32,
  bank [L, E, P] (bfloat16, float32, int8, uint8 for mxfp4 or uint16 for int4); ``variant``
  (static) the experts' activation and biases. Returns [T, D] float32.
  """
  if kernels in ("ffi", "ffi_bf16", "ffi_int8"):
    return expert_ffn(x, ids, weights, bank, layer, ffn_dim=ffn_dim,
                      bf16_activations=kernels == "ffi_bf16",
                      int8_activations=kernels == "ffi_int8", variant=variant)
  if kernels != "xla":
    raise ValueError(f"unknown kernels {kernels!r}; expected one of {KERNELS}")
  if variant.bias and bank.dtype == jnp.int8:
    raise ValueError("int8 expert blocks carry no biases (their layout ends with the float32 "
                     "row scales): keep a model with expert biases in bf16")
  if bank.dtype == jnp.uint16 and variant.bias:
    raise ValueError("int4 expert blocks carry no biases: keep gpt-oss's experts in mxfp4 (as "
                     "shipped) or bf16")
  if bank.dtype not in (jnp.int8, jnp.uint8, jnp.uint16) and \
      bank.shape[-1] < variant.block_elems(ffn_dim, x.shape[-1]):
    raise ValueError(
        f"bank blocks of {bank.shape[-1]} elements are too small for experts of ffn_dim="
        f"{ffn_dim}, D={x.shape[-1]}{' with biases' if variant.bias else ''}")
  bank_ep = bank[layer]
  if ids.size <= bank_ep.shape[0]:
    return _routed_gather(x, ids, weights, bank_ep, ffn_dim, variant)
  return _routed_scan(x, ids, weights, bank_ep, ffn_dim, variant)


@struct.dataclass
class BankExperts:
  """The reference routed-experts function: every route runs from the host bank.

  Implements ``ftjax.model.moe.RoutedExperts``: ``experts(x, weights, ids, layer) ->
  (experts, y)``; it carries no state, so it returns itself.
  """
  bank: jax.Array  # [L, E, P]
  ffn_dim: int = struct.field(pytree_node=False)
  kernels: str = struct.field(pytree_node=False, default="xla")
  variant: ExpertVariant = struct.field(pytree_node=False, default=SWIGLU)

  def __call__(self, x, weights, ids, layer: int) -> tuple["BankExperts", jax.Array]:
    return self, routed_experts(x, ids, weights, self.bank, layer, ffn_dim=self.ffn_dim,
                                kernels=self.kernels, variant=self.variant)
