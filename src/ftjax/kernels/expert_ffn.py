"""Host SwiGLU expert FFN: the XLA FFI op `ftjax_expert_ffn` (C++ in xla_ffi/expert_ffn.cc).

For tokens x [T, D], routes ids [T, K] (-1 skips a route) with weights [T, K], and one
layer of an expert bank [L, E, P]:

    y[t] = sum_k weights[t, k] * down_e(silu(gate_e @ x[t]) * (up_e @ x[t])),  e = ids[t, k]

Each expert block bank[layer, e] holds, row-major and contiguous, gate [F, D] at element
offset 0, up [F, D] at F*D and down [D, F] at 2*F*D; P >= 3*F*D and the rest is padding.
The kernel accumulates in float32 and returns float32. An int8 bank (the FTW expert format
"int8", ftjax.utils.quant) holds the int8 weights so, then the float32 scales of their rows
from byte int8_scales_offset(F, D); P is in bytes, a multiple of 64. The int8 weights are
widened exactly to float32 and each output row is scaled once after its dot product, so the
result is that of the dequantised weights to float32 rounding; a decode call reads a quarter
of the bytes of a float32 bank. int8_activations=True (opt-in, AVX-512-VNNI CPUs) quantises the
activations to int8 too and multiplies with vpdpbusd. An mxfp4 bank (uint8, the FTW expert
format "mxfp4", gpt-oss's MXFP4 as shipped: ftjax.utils.quant) holds 4-bit E2M1 codes with an
E8M0 scale per 32 inputs, then float32 biases for a variant with bias=True (none without:
every family but gpt-oss); F and D must be multiples of 32 and P a multiple of 64 bytes. The kernel decodes the codes times their scale
(exact in float32) and multiplies in float32: the result is that of the dequantised weights,
and a decode call reads the 4.25-bit bytes. With int8_activations=True (opt-in, any x86 CPU) a
decode call (T <= 8) quantises the activations per block of 32 inputs instead (llama.cpp's
Q8_0) and multiplies integers: on AVX2 the exact form is bound by its instructions at about half
the read bandwidth, this one is not; a prefill call (T > 8) stays exact. An int4 bank (uint16
words: the FTW expert format "int4", ftjax.utils.quant) holds unsigned 4-bit codes with a scale
and a min per 32 inputs under per-row float32 steps (4.5 bits a weight, as llama.cpp's Q4_K), no
biases; the kernel multiplies the format's float32 weights in float32 (decode: fused, 4.5-bit
bytes read once; prefill: rows decoded to float32 per task, the packed GEMM). With
bf16_activations a prefill call (T > 8) rounds the decoded rows to bf16 as well (relative error
<= 2^-9 a weight, far inside the format's own step) and runs the bf16-pair GEMM (AMX tiles
where enabled); a decode call stays exact.

Two forms inside, chosen by T: decode (T <= 8: distinct experts found once, each expert read
once for all its tokens, its rows split across the threads) and grouped prefill (routes bucketed
by expert, empty experts skipped, blocked GEMM over each expert's tokens). Products are exact
(bf16 weights widened to float32) unless bf16_activations=True asks for vdpbf16ps on
AVX-512-BF16 CPUs (relative error ~1e-2 of max|y|). Environment: FTJAX_ISA,
FTJAX_NUM_THREADS, FTJAX_THREAD_POOL (see ftjax.kernels).

To run experts from cache slots, pass the slot buffer as bank [1, N, P] with layer 0 and slot
numbers as ids.

``variant`` (an ``ExpertVariant``) chooses the expert's function: the SwiGLU above by default,
or gpt-oss's clamped SwiGLU, and whether each block carries biases (gate [F] at element
3*F*D, up [F] after it, down [D] after that, in the bank's dtype; P >= 3*F*D + 2*F + D):

    g = gate_e @ x + b_gate,  u = up_e @ x + b_up
    clamped_swiglu: g = min(g, limit), u = clip(u, -limit, limit),
                    h = (u + 1) * g * sigmoid(alpha * g)
    y[t] = sum_k weights[t, k] * (down_e @ h + b_down)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels._registration import require
from ftjax.kernels._registration import shape_and_dtype as _shape_and_dtype
from ftjax.utils.quant import (INT4_BLOCK, INT8_SCALES_ALIGNMENT, MXFP4_ALIGNMENT, MXFP4_BLOCK,
                               int4_block_bytes, int8_block_bytes, int8_scales_offset,
                               mxfp4_block_bytes)

_BANK_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.int8),
                np.dtype(np.uint8), np.dtype(np.uint16))
ACTIVATIONS = ("swiglu", "clamped_swiglu")


@dataclasses.dataclass(frozen=True)
class ExpertVariant:
  """The routed experts' function (static, hashable): ``activation`` ("swiglu": silu(g) * u;
  "clamped_swiglu": gpt-oss's ``(clip(u, ±limit) + 1) * g' * sigmoid(alpha * g')`` with
  ``g' = min(g, limit)``), and ``bias``: each expert block holds gate, up and down biases
  after down (see the module docstring)."""
  activation: str = "swiglu"
  alpha: float = 1.702
  limit: float = 7.0
  bias: bool = False

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")

  def block_elems(self, ffn_dim: int, width: int) -> int:
    """Elements an expert block needs: 3·F·D, plus 2·F + D with biases."""
    return 3 * ffn_dim * width + ((2 * ffn_dim + width) if self.bias else 0)


SWIGLU = ExpertVariant()


def expert_ffn(x, ids, weights, bank, layer, *, ffn_dim, bf16_activations=False,
               int8_activations=False, variant: ExpertVariant = SWIGLU):
  """Weighted sum of the routed SwiGLU experts of one layer, on the host.

  Args:
    x: [T, D] float32 tokens.
    ids: [T, K] int32 expert ids in [-1, E); -1 skips the route. Values are checked by
      the kernel at run time (they may be traced).
    weights: [T, K] float32 route weights.
    bank: [L, E, P] bfloat16, float32, int8, uint8 (mxfp4) or uint16 (int4) expert blocks
      (may be traced); int8 blocks carry their float32 row scales, mxfp4 blocks their E8M0
      block scales and float32 biases, int4 blocks their per-row parameters (module
      docstring).
    layer: int32 scalar in [0, L) (may be traced; checked here when concrete and by the
      kernel at run time).
    ffn_dim: F, the expert hidden width; a static Python int.
    bf16_activations: for a bf16 bank on a CPU with AVX-512-BF16, round the activations (x
      and the hidden h) to bf16 and multiply with vdpbf16ps: twice the multiply-add rate,
      which the grouped (prefill) form gains from, at a relative error of ~1e-2 of max|y|.
      When False (the default), bf16 weights are widened to float32 and the result is exact
      to ~1e-5 like a float32 bank; the decode form runs at read bandwidth either way. An
      mxfp4 or int4 bank's prefill (T > 8) takes the same bf16-pair GEMM on its rows decoded
      per task (int4's rounded to bf16); its decode form stays exact.
    int8_activations: for an int8 bank on a CPU with AVX-512-VNNI (the avx512bf16 kernels;
      elsewhere the call fails, naming the fix), quantise x per token and the hidden h per
      route to int8 (symmetric, scale max|row| / 127) and multiply with vpdpbusd: about a
      quarter of the instructions of the exact path, whose float32 widening can bound int8
      decode below read bandwidth, at the error of 8-bit activations (~1e-2 of max|y|).
      For an mxfp4 bank (any CPU), a decode call (T <= 8) quantises x and h per block of 32
      inputs (scale max|block| / 127, as llama.cpp's Q8_0) and sums exact integers per block
      (vpmaddubsw on AVX2 and AVX-512): 11 vector operations per 64 weights against the exact
      form's 29; a prefill call (T > 8) stays exact. Opt-in only; the default is the exact
      path.
    variant: the expert's activation and biases (``ExpertVariant``); static.

  Returns:
    y: [T, D] float32.

  Raises:
    ValueError: naming the argument whose shape, dtype or value is wrong.
  """
  x_shape, x_dtype = _shape_and_dtype("x", x)
  ids_shape, ids_dtype = _shape_and_dtype("ids", ids)
  weights_shape, weights_dtype = _shape_and_dtype("weights", weights)
  bank_shape, bank_dtype = _shape_and_dtype("bank", bank)

  if len(x_shape) != 2:
    raise ValueError(f"x must be 2-D [T, D], got shape {x_shape}")
  if x_dtype != np.float32:
    raise ValueError(f"x must be float32, got {x_dtype}")
  T, D = x_shape

  if len(ids_shape) != 2 or ids_shape[0] != T:
    raise ValueError(f"ids must be [T, K] with T = {T} from x, got shape {ids_shape}")
  if ids_dtype != np.int32:
    raise ValueError(f"ids must be int32, got {ids_dtype}")

  if weights_shape != ids_shape:
    raise ValueError(f"weights must be [T, K] = {ids_shape} like ids, got shape {weights_shape}")
  if weights_dtype != np.float32:
    raise ValueError(f"weights must be float32, got {weights_dtype}")

  if len(bank_shape) != 3:
    raise ValueError(f"bank must be 3-D [L, E, P], got shape {bank_shape}")
  if bank_dtype not in _BANK_DTYPES:
    raise ValueError(f"bank must be bfloat16, float32, int8 (an int8 expert bank), uint8 (an "
                     f"mxfp4 expert bank) or uint16 (an int4 expert bank), got {bank_dtype}")
  L, _, P = bank_shape

  if isinstance(ffn_dim, (bool, np.bool_)) or not isinstance(ffn_dim, (int, np.integer)):
    raise ValueError(f"ffn_dim must be a Python int, got {ffn_dim!r}")
  if ffn_dim <= 0:
    raise ValueError(f"ffn_dim must be positive, got {ffn_dim}")
  if not isinstance(variant, ExpertVariant):
    raise ValueError(f"variant must be an ExpertVariant, got {variant!r}")
  if bank_dtype == np.uint8:
    _check_mxfp4(P, ffn_dim, D, variant)
  elif bank_dtype == np.uint16:
    _check_int4(P, ffn_dim, D, variant)
  elif P < variant.block_elems(ffn_dim, D):
    raise ValueError(
      f"bank's last dimension P = {P} is smaller than 3 * ffn_dim * D = 3 * {ffn_dim} * {D}"
      + (f" plus the biases 2 * ffn_dim + D = {2 * ffn_dim + D}" if variant.bias else "")
    )
  if bank_dtype == np.int8:
    need = int8_block_bytes(ffn_dim, D)
    if P < need:
      raise ValueError(
        f"int8 bank's last dimension P = {P} is smaller than the {need} bytes of an int8 block "
        f"(F = {ffn_dim}, D = {D}: weights, then float32 scales from byte "
        f"{int8_scales_offset(ffn_dim, D)}); quantise with ftjax.utils.quant.quantize_bank"
      )
    if P % INT8_SCALES_ALIGNMENT:
      raise ValueError(f"int8 bank's last dimension P = {P} must be a multiple of "
                       f"{INT8_SCALES_ALIGNMENT} bytes; pad the blocks with zeros")

  _check_layer(layer, L)
  if not isinstance(bf16_activations, (bool, np.bool_)):
    raise ValueError(f"bf16_activations must be a bool, got {bf16_activations!r}")
  if not isinstance(int8_activations, (bool, np.bool_)):
    raise ValueError(f"int8_activations must be a bool, got {int8_activations!r}")
  if int8_activations and bank_dtype not in (np.int8, np.uint8):
    raise ValueError(f"int8_activations applies to int8 and mxfp4 banks only, got a "
                     f"{bank_dtype} bank")

  require("expert_ffn")
  if variant.bias and bank_dtype == np.int8:
    raise ValueError("int8 expert blocks carry no biases (their layout ends with the float32 "
                     "row scales): keep a model with expert biases in bf16")
  call = _batchable_call(int(ffn_dim), bool(bf16_activations), bool(int8_activations), variant)
  return call(x, ids, weights, bank, jnp.asarray(layer, jnp.int32))


def _check_mxfp4(P, ffn_dim, D, variant):
  if ffn_dim % MXFP4_BLOCK or D % MXFP4_BLOCK:
    raise ValueError(f"an mxfp4 bank needs ffn_dim and D to be multiples of {MXFP4_BLOCK}, got "
                     f"ffn_dim = {ffn_dim}, D = {D}")
  need = mxfp4_block_bytes(ffn_dim, D, variant.bias)
  if P < need:
    raise ValueError(f"mxfp4 bank's last dimension P = {P} is smaller than the {need} bytes of "
                     f"an mxfp4 block (F = {ffn_dim}, D = {D}: codes, scales"
                     f"{', float32 biases' if variant.bias else ''})")
  if P % MXFP4_ALIGNMENT:
    raise ValueError(f"mxfp4 bank's last dimension P = {P} must be a multiple of "
                     f"{MXFP4_ALIGNMENT} bytes; pad the blocks with zeros")


def _check_int4(P, ffn_dim, D, variant):
  if ffn_dim % INT4_BLOCK or D % INT4_BLOCK:
    raise ValueError(f"an int4 bank needs ffn_dim and D to be multiples of {INT4_BLOCK}, got "
                     f"ffn_dim = {ffn_dim}, D = {D}")
  if variant.bias:
    raise ValueError("int4 expert blocks carry no biases: keep gpt-oss's experts in mxfp4 (as "
                     "shipped) or bf16")
  need = int4_block_bytes(ffn_dim, D)
  if 2 * P < need:
    raise ValueError(f"int4 bank's last dimension P = {P} (uint16 words) is smaller than the "
                     f"{need} bytes of an int4 block (F = {ffn_dim}, D = {D}: codes, row "
                     "parameters); quantise with ftjax.utils.quant.quantize_int4_bank")
  if (2 * P) % MXFP4_ALIGNMENT:
    raise ValueError(f"int4 bank's last dimension P = {P} words must be a multiple of "
                     f"{MXFP4_ALIGNMENT} bytes; pad the blocks with zeros")


def _call(x, ids, weights, bank, layer, ffn_dim, bf16_activations, int8_activations, variant):
  call = jax.ffi.ffi_call(
    "ftjax_expert_ffn",
    jax.ShapeDtypeStruct(x.shape, jnp.float32),
    vmap_method="sequential",
  )
  return call(
    x, ids, weights, bank, layer, ffn_dim=np.int64(ffn_dim), bf16_activations=bf16_activations,
    int8_activations=int8_activations, activation=variant.activation,
    alpha=np.float32(variant.alpha), limit=np.float32(variant.limit), biases=bool(variant.bias),
  )


@functools.cache
def _batchable_call(ffn_dim, bf16_activations, int8_activations, variant):
  """The op for one F, with a vmap rule: tokens are independent, so a batch over x, ids and
  weights with bank and layer unbatched becomes one call over B * T tokens; anything else runs
  one call per batch element."""

  @jax.custom_batching.custom_vmap
  def expert_ffn_call(x, ids, weights, bank, layer):
    return _call(x, ids, weights, bank, layer, ffn_dim, bf16_activations, int8_activations,
                 variant)

  @expert_ffn_call.def_vmap
  def expert_ffn_vmap(axis_size, in_batched, *args):
    if not in_batched[3] and not in_batched[4]:
      x, ids, weights = (
        a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
        for a, batched in zip(args[:3], in_batched[:3])
      )
      B, T, D = x.shape
      y = expert_ffn_call(
        jnp.reshape(x, (B * T, D)),
        jnp.reshape(ids, (B * T, -1)),
        jnp.reshape(weights, (B * T, -1)),
        args[3],
        args[4],
      )
      return jnp.reshape(y, (B, T, D)), True
    batched = tuple(a for a, b in zip(args, in_batched) if b)

    def one(batched_slice):
      it = iter(batched_slice)
      return expert_ffn_call(*(next(it) if b else a for a, b in zip(args, in_batched)))

    return jax.lax.map(one, batched), True

  return expert_ffn_call


def _check_layer(layer, num_layers):
  """Checks that `layer` is an integer scalar, and in [0, L) when its value is known."""
  if isinstance(layer, (bool, np.bool_)):
    raise ValueError(f"layer must be an integer scalar, got {layer!r}")
  if isinstance(layer, (int, np.integer)):
    value = int(layer)
  else:
    shape, dtype = _shape_and_dtype("layer", layer)
    if shape != () or not np.issubdtype(dtype, np.integer):
      raise ValueError(f"layer must be an integer scalar, got shape {shape} dtype {dtype}")
    if not isinstance(layer, np.ndarray):
      return  # a jax value, possibly traced: the kernel checks it at run time
    value = int(layer)
  if not 0 <= value < num_layers:
    raise ValueError(f"layer = {value} is outside [0, L) with L = {num_layers}")
