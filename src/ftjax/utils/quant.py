"""The quantised expert formats, ``int8``, ``mxfp4`` and ``int4``: block layouts and
(de)quantisation (numpy; int4's quantiser also in C++), shared by the FTW writer, the kernels'
input checks and the XLA dequantisation (specified in ``docs/ftw.md``).

An int8 expert block is P bytes: the int8 weights ``gate [F, D] | up [F, D] | down [D, F]``
from byte 0 (the float layout's element offsets, one byte per weight), then from byte
``int8_scales_offset(F, D)`` (``3·F·D`` rounded up to 64) the float32 scales of their rows,
``gate [F] | up [F] | down [D]``, then zero padding. Weight ``w[r, i]`` stands for
``scale[r] · q[r, i]``: symmetric, one scale per output channel (row).

Quantisation of a float row ``w`` (bfloat16 or float32, taken as float32):
``scale = float32(max|w| / 127)`` and ``q = round_half_to_even(w / scale)`` in float32 (so
``|q| <= 127``); an all-zero row gets ``scale = 0`` and ``q = 0``.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np

INT8_SCALES_ALIGNMENT = 64
QMAX = 127
EXPERT_FORMATS = ("bfloat16", "float32", "int8", "int4", "mxfp4")  # the bank formats ftjax reads
QUANTISED_EXPERT_FORMATS = ("int8", "int4", "mxfp4")  # those whose bytes no float dtype gives


def int8_scales_offset(ffn_dim: int, width: int) -> int:
  """Byte offset of an int8 block's float32 scales: its ``3·F·D`` weights, rounded up to 64."""
  weights = 3 * ffn_dim * width
  return -(-weights // INT8_SCALES_ALIGNMENT) * INT8_SCALES_ALIGNMENT


def int8_block_bytes(ffn_dim: int, width: int) -> int:
  """Bytes of an int8 block's content (weights and scales), before any padding."""
  return int8_scales_offset(ffn_dim, width) + 4 * (2 * ffn_dim + width)


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``w [R, C]`` float -> ``(q [R, C] int8, scale [R] float32)``, per row (module docstring)."""
  w = np.asarray(w)
  if w.ndim != 2 or not (np.issubdtype(w.dtype, np.floating) or w.dtype == ml_dtypes.bfloat16):
    raise ValueError(f"quantize_rows takes a 2-D float array, got {w.dtype} of shape {w.shape}")
  w = w.astype(np.float32)
  if not np.all(np.isfinite(w)):
    raise ValueError("cannot quantise weights that are not finite (NaN or inf in the rows)")
  scale = np.max(np.abs(w), axis=1) / np.float32(QMAX)  # float32 / float32: float32
  safe = np.where(scale > 0, scale, np.float32(1))[:, None]
  q = np.rint(w / safe)  # round half to even
  return np.clip(q, -QMAX, QMAX).astype(np.int8), scale.astype(np.float32)


def quantize_block(gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                   block_bytes: int | None = None) -> np.ndarray:
  """One int8 expert block (uint8 view, ``block_bytes`` long, default the unpadded size) from
  float ``gate [F, D]``, ``up [F, D]``, ``down [D, F]``."""
  ffn_dim, width = gate.shape
  size = int8_block_bytes(ffn_dim, width)
  block_bytes = size if block_bytes is None else block_bytes
  if block_bytes < size:
    raise ValueError(f"an int8 block of F={ffn_dim}, D={width} needs {size} bytes, got "
                     f"{block_bytes}")
  block = np.zeros(block_bytes, np.uint8)
  offset = int8_scales_offset(ffn_dim, width)
  starts = (0, ffn_dim * width, 2 * ffn_dim * width)
  scale_starts = (0, ffn_dim, 2 * ffn_dim)
  scales = block[offset:offset + 4 * (2 * ffn_dim + width)].view(np.float32)
  for part, start, scale_start in zip((gate, up, down), starts, scale_starts):
    q, s = quantize_rows(part)
    block[start:start + q.size] = q.reshape(-1).view(np.uint8)
    scales[scale_start:scale_start + len(s)] = s
  return block


def dequantize_block(block: np.ndarray, ffn_dim: int, width: int,
                     dtype=np.float64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(gate, up, down)`` of an int8 block (any 1-byte dtype view) as ``scale · q`` in
  ``dtype`` (float64 by default: exact)."""
  raw = np.asarray(block).view(np.uint8)
  fd = ffn_dim * width
  q = raw[:3 * fd].view(np.int8).astype(dtype)
  offset = int8_scales_offset(ffn_dim, width)
  scales = raw[offset:offset + 4 * (2 * ffn_dim + width)].view(np.float32).astype(dtype)
  gate = q[:fd].reshape(ffn_dim, width) * scales[:ffn_dim, None]
  up = q[fd:2 * fd].reshape(ffn_dim, width) * scales[ffn_dim:2 * ffn_dim, None]
  down = q[2 * fd:].reshape(width, ffn_dim) * scales[2 * ffn_dim:, None]
  return gate, up, down


def quantize_bank(bank: np.ndarray, ffn_dim: int, width: int,
                  block_bytes: int | None = None) -> np.ndarray:
  """A float bank ``[L, E, P]`` (blocks ``gate | up | down``) as an int8 bank
  ``[L, E, block_bytes]`` (default: the unpadded block size rounded up to 64)."""
  bank = np.asarray(bank)
  fd = ffn_dim * width
  if block_bytes is None:
    block_bytes = -(-int8_block_bytes(ffn_dim, width) // 64) * 64
  num_layers, num_experts = bank.shape[:2]
  out = np.zeros((num_layers, num_experts, block_bytes), np.uint8)
  for layer in range(num_layers):
    for expert in range(num_experts):
      b = bank[layer, expert]
      out[layer, expert] = quantize_block(b[:fd].reshape(ffn_dim, width),
                                          b[fd:2 * fd].reshape(ffn_dim, width),
                                          b[2 * fd:3 * fd].reshape(width, ffn_dim), block_bytes)
  return out.view(np.int8)


# ---------------------------------------------------------------------------------------------
# mxfp4 (OCP MX FP4, as gpt-oss ships its experts).
#
# Each row of a part ``[out, in]`` is cut into blocks of 32 inputs; a block is 16 bytes of
# 4-bit E2M1 codes (input ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high one)
# and one E8M0 scale byte ``e`` standing for ``2**(e - 127)``. Weight = ``E2M1[code] ·
# 2**(e - 127)``, exact in float32 (e = 255, NaN in the OCP spec, is refused). A block of an
# mxfp4 bank is, with ``S = align64(3·F·D/2)`` and ``B = S + align64(3·F·D/32)``:
#   codes  gate [F, D/2] at 0, up [F, D/2] at F·D/2, down [D, F/2] at F·D;
#   scales gate [F, D/32] at S, up [F, D/32] at S + F·D/32, down [D, F/32] at S + F·D/16;
#   biases (float32; only for experts with biases, gpt-oss's) gate [F] at B, up [F] at B + 4·F,
#   down [D] at B + 8·F;
# then zero padding. F and D must be multiples of 32. Experts without biases (every family but
# gpt-oss) end at B: the same codes and scales, nothing after them.

MXFP4_BLOCK = 32  # inputs per scale
MXFP4_ALIGNMENT = 64
MXFP4_SCALE_NAN = 255
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def _align(n: int, alignment: int = MXFP4_ALIGNMENT) -> int:
  return -(-n // alignment) * alignment


def check_mxfp4_shape(ffn_dim: int, width: int) -> None:
  if ffn_dim % MXFP4_BLOCK or width % MXFP4_BLOCK:
    raise ValueError(f"mxfp4 experts need F and D to be multiples of {MXFP4_BLOCK} (the scale "
                     f"blocks of 32 inputs), got F={ffn_dim}, D={width}: keep these experts in "
                     "bfloat16 or int8")


def mxfp4_offsets(ffn_dim: int, width: int) -> dict[str, dict[str, int]]:
  """Byte offsets in an mxfp4 block: ``{"codes"|"scales"|"biases": {part: offset}}``."""
  f, d = ffn_dim, width
  fd = f * d
  scales = _align(3 * fd // 2)
  biases = scales + _align(3 * fd // MXFP4_BLOCK)
  return {"codes": {"gate": 0, "up": fd // 2, "down": fd},
          "scales": {"gate": scales, "up": scales + fd // MXFP4_BLOCK,
                     "down": scales + 2 * fd // MXFP4_BLOCK},
          "biases": {"gate": biases, "up": biases + 4 * f, "down": biases + 8 * f}}


def mxfp4_block_bytes(ffn_dim: int, width: int, bias: bool = True) -> int:
  """Bytes of an mxfp4 block's content (codes, scales, and with ``bias`` the float32 biases),
  before padding."""
  check_mxfp4_shape(ffn_dim, width)
  if not bias:
    return mxfp4_offsets(ffn_dim, width)["biases"]["gate"]
  return mxfp4_offsets(ffn_dim, width)["biases"]["down"] + 4 * width



# Midpoints between neighbouring E2M1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6).
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``w [R, C]`` float (C a multiple of 32) -> ``(codes [R, C/2], scales [R, C/32])`` uint8
  (docs/ftw.md, ``--expert_dtype=mxfp4``): per block of 32 inputs the smallest ``2**k`` with
  ``max|w| / 2**k <= 6`` (E2M1's largest magnitude; k clipped to [-127, 127], an all-zero block
  gets k = 0), then each ``w / 2**k`` rounded to the nearest E2M1 value, ties to the even code."""
  w = np.asarray(w)
  if w.ndim != 2 or w.shape[1] % MXFP4_BLOCK:
    raise ValueError(f"quantize_mxfp4 takes [R, C] with C a multiple of {MXFP4_BLOCK}, got "
                     f"shape {w.shape}")
  w = w.astype(np.float64)  # bfloat16 and float32 values are exact in float64
  if not np.all(np.isfinite(w)):
    raise ValueError("cannot quantise weights that are not finite (NaN or inf in the rows)")
  rows, cols = w.shape
  blocks = w.reshape(rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
  largest = np.max(np.abs(blocks), axis=-1)
  mantissa, exponent = np.frexp(largest / 6.0)  # largest / 6 = mantissa · 2**exponent, m in [0.5, 1)
  k = np.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2(largest / 6))
  k = np.clip(np.where(largest > 0, k, 0), -127, 127)
  scaled = np.abs(blocks) / np.ldexp(1.0, k)[..., None]
  code = np.searchsorted(_E2M1_MIDPOINTS, scaled, side="left")  # ties: the smaller magnitude
  tie = (code < len(_E2M1_MIDPOINTS)) & (scaled == _E2M1_MIDPOINTS[np.minimum(code, 6)])
  code = np.where(tie & (code % 2 == 1), code + 1, code)  # ... unless its code is odd
  code = np.where((blocks < 0) & (code > 0), code + 8, code).reshape(rows, cols).astype(np.uint8)
  return code[:, 0::2] | (code[:, 1::2] << 4), (k + 127).astype(np.uint8)


def quantize_mxfp4_bank(bank: np.ndarray, ffn_dim: int, width: int,
                        block_bytes: int | None = None, bias: bool = True) -> np.ndarray:
  """A float bank ``[L, E, P]`` (blocks ``gate | up | down``, then with ``bias`` ``gate_bias |
  up_bias | down_bias``) as an mxfp4 bank ``[L, E, block_bytes]`` uint8 (default: the content
  rounded up to 64), weights by ``quantize_mxfp4``, biases in float32."""
  bank = np.asarray(bank)
  f, d = ffn_dim, width
  fd = f * d
  at = mxfp4_offsets(f, d)
  block_bytes = block_bytes or _align(mxfp4_block_bytes(f, d, bias))
  out = np.zeros((*bank.shape[:2], block_bytes), np.uint8)
  shapes = {"gate": (0, (f, d)), "up": (fd, (f, d)), "down": (2 * fd, (d, f))}
  biases = ({"gate": (3 * fd, f), "up": (3 * fd + f, f), "down": (3 * fd + 2 * f, d)}
            if bias else {})
  for layer in range(bank.shape[0]):
    for expert in range(bank.shape[1]):
      block, dst = bank[layer, expert], out[layer, expert]
      for part, (start, shape) in shapes.items():
        codes, scales = quantize_mxfp4(block[start:start + fd].reshape(shape))
        dst[at["codes"][part]:at["codes"][part] + codes.size] = codes.ravel()
        dst[at["scales"][part]:at["scales"][part] + scales.size] = scales.ravel()
      for part, (start, n) in biases.items():
        values = block[start:start + n].astype(np.float32)
        dst[at["biases"][part]:at["biases"][part] + 4 * n] = values.view(np.uint8)
  return out


# -- int4: unsigned 4-bit codes with a scale and a min per block of 32 inputs ---------------------
#
# Row r of a weight [R, C] (C a multiple of 32) is C / 2 code bytes (input 2j in the low nibble
# of byte j, as mxfp4) and int4_param_bytes(C) = 8 + 2·C/32 parameter bytes: the row's float32
# steps d and dm (little-endian), then a uint8 scale s[b] per block b of 32 inputs, then an int8
# min m[b] per block. Input i of block b = i // 32 stands for
#     w = float32(d·s[b]·q + dm·m[b]),  q in [0, 15],
# one rounding: d has at most 12 significant bits and dm at most 16, so d·s·q (24 bits) and dm·m
# (23 bits) are exact in float32, and every evaluation (float32 products then one addition, a
# fused multiply-add, float64) gives the same float32 weight.
# 4.5 bits a weight plus 64 a row: llama.cpp's Q4_K has the same shape (an unsigned 4-bit code,
# a scale and a min per 32 weights), with 6-bit scales under a per-256 step.

INT4_BLOCK = 32
_INT4_SHRINK = (0.0, 0.05, 0.1)  # the search's cuts off each end of a block's range
_INT4_REFITS = 4
_INT4_ROWS_AT_ONCE = 2048


_INT4_D_BITS = 12   # significant bits of a row's d: d·s·q exact in float32 (12 + 8 + 4)
_INT4_DM_BITS = 16  # and of dm: dm·m exact (16 + 7)


def _round_up_bits(x: np.ndarray, bits: int) -> np.ndarray:
  """Positive ``x`` (float64) rounded up to ``bits`` significant bits, as float32 (exact); 1
  where x is 0. Clipped to float32's normal range."""
  x = np.clip(x, np.finfo(np.float32).tiny * 2 ** bits, np.finfo(np.float32).max / 2)
  mantissa, exponent = np.frexp(x)  # x = mantissa · 2**exponent, mantissa in [0.5, 1)
  up = np.ldexp(np.ceil(np.ldexp(mantissa, bits)), exponent - bits)
  return np.where(x > np.finfo(np.float32).tiny * 2 ** bits, up, 1.0).astype(np.float32)


def int4_param_bytes(cols: int) -> int:
  """Parameter bytes of one int4 row of ``cols`` inputs: float32 d, dm, then ``cols / 32``
  uint8 scales and as many int8 mins."""
  return 8 + 2 * (cols // INT4_BLOCK)


def _int4_fit(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per block ``x [..., 32]`` (float32) the scale d > 0 and min m of the fit x ≈ d·q + m,
  q = clip(rint((x - m) / d), 0, 15), that has the least weighted squared error among the
  searched ones. Weights: rms(block) + |x| (larger weights count more, as llama.cpp's Q4_K
  quantiser weighs them without an importance matrix). Search: the block's range [min(x, 0),
  max(x, 0)] with 0, 5% or 10% cut off either end, each refitted 4 times by weighted least
  squares of x on the codes it gives (2 refits: 1.5% more squared error on Gaussian rows, and
  on the embedded hybrid model the 4-bit preset's KL to bf16 0.00125 against 0.00118; a finer
  grid of cuts, 0.00118 too).
  In float32: the fit only chooses parameters, which are rounded and checked after."""
  weight = np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) + np.abs(x)
  lo = np.minimum(x.min(-1), 0.0)
  hi = np.maximum(x.max(-1), 0.0)
  best_d = best_m = best_err = None
  for cut_lo in _INT4_SHRINK:
    for cut_hi in _INT4_SHRINK:
      span = hi - lo
      m = lo + cut_lo * span
      d = (hi - cut_hi * span - m) / 15.0
      d = np.where(d > 0, d, np.float32(1))
      for _ in range(_INT4_REFITS):
        q = np.clip(np.rint((x - m[..., None]) / d[..., None]), 0, 15)
        sw = weight.sum(-1)
        sq = (weight * q).sum(-1)
        sqq = (weight * q * q).sum(-1)
        sx = (weight * x).sum(-1)
        sqx = (weight * q * x).sum(-1)
        det = sw * sqq - sq * sq
        ok = det > 1e-6 * sw * sqq
        new_d = np.where(ok, (sw * sqx - sq * sx) / np.where(ok, det, np.float32(1)), d)
        new_m = np.where(ok, (sx - new_d * sq) / sw, m)
        good = ok & (new_d > 0)
        d = np.where(good, new_d, d)
        m = np.where(good, new_m, m)
      q = np.clip(np.rint((x - m[..., None]) / d[..., None]), 0, 15)
      err = (weight * (d[..., None] * q + m[..., None] - x) ** 2).sum(-1)
      if best_err is None:
        best_d, best_m, best_err = d, m, err
      else:
        better = err < best_err
        best_d = np.where(better, d, best_d)
        best_m = np.where(better, m, best_m)
        best_err = np.where(better, err, best_err)
  # An all-zero block: scale 0 and min 0 (stored as s = 0), so that it decodes to exact zeros
  # and adds nothing to a row's sums however the kernels group them.
  zero = hi - lo == 0
  return np.where(zero, np.float32(0), best_d), np.where(zero, np.float32(0), best_m)


def _int4_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  rows, cols = w.shape
  blocks = cols // INT4_BLOCK
  x = w.reshape(rows, blocks, INT4_BLOCK)
  d, m = (v.astype(np.float64) for v in _int4_fit(x))
  x = x.astype(np.float64)
  # The row's steps: the largest scale is 255 steps of d_row, the largest |min| 127 of dm_row.
  d_row = _round_up_bits(d.max(-1) / 255.0, _INT4_D_BITS)
  dm_row = _round_up_bits(np.abs(m).max(-1) / 127.0, _INT4_DM_BITS)
  s = np.where(d > 0, np.clip(np.rint(d / d_row[:, None].astype(np.float64)), 1, 255), 0)
  mi = np.clip(np.rint(m / dm_row[:, None].astype(np.float64)), -127, 127)
  # The codes against the stored block scale and min (as the kernels compute them).
  scale = (d_row[:, None] * s.astype(np.float32)).astype(np.float64)
  offset = (dm_row[:, None] * mi.astype(np.float32)).astype(np.float64)
  safe = np.where(scale > 0, scale, 1.0)[..., None]
  q = np.where(scale[..., None] > 0, np.clip(np.rint((x - offset[..., None]) / safe), 0, 15), 0)
  q = q.astype(np.uint8)
  q = q.reshape(rows, cols)
  codes = q[:, 0::2] | (q[:, 1::2] << 4)
  params = np.empty((rows, int4_param_bytes(cols)), np.uint8)
  params[:, 0:4] = d_row.astype("<f4").view(np.uint8).reshape(rows, 4)
  params[:, 4:8] = dm_row.astype("<f4").view(np.uint8).reshape(rows, 4)
  params[:, 8:8 + blocks] = s.astype(np.uint8)
  params[:, 8 + blocks:] = mi.astype(np.int8).view(np.uint8)
  return codes, params


def quantize_int4(w: np.ndarray, *, reference: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """``w [R, C]`` float (C a multiple of 32) -> ``(codes [R, C/2], params [R, 8 + C/16])``
  uint8 (the int4 layout above). Per block of 32 the scale and min of the best weighted fit
  (``_int4_fit``); per row the steps d = max scale / 255 and dm = max |min| / 127 (float32),
  each block's scale and min rounded to those steps (uint8 s >= 1, int8 m; s = m = 0 and codes 0
  for an all-zero block), then each input's code rounded against the stored scale and min.

  Runs in C++ on every core where the kernels layer installed it (``set_native_int4``:
  xla_ffi/quantize_int4.cc, the same algorithm, ~5x the numpy form's speed a core);
  ``reference=True``, or no compiled module (said on stderr once), runs the numpy form here,
  whose float32 sums are pairwise: the two agree on all but a few near-ties
  (tests/formats/test_int4.py)."""
  w = np.asarray(w)
  if w.ndim != 2 or w.shape[1] % INT4_BLOCK:
    raise ValueError(f"quantize_int4 takes [R, C] with C a multiple of {INT4_BLOCK}, got "
                     f"shape {w.shape}")
  if not np.all(np.isfinite(w)):
    raise ValueError("cannot quantise weights that are not finite (NaN or inf in the rows)")
  rows, cols = w.shape
  codes = np.empty((rows, cols // 2), np.uint8)
  params = np.empty((rows, int4_param_bytes(cols)), np.uint8)
  native = None if reference else _native_int4()
  if native is not None:
    native(np.ascontiguousarray(w, np.float32), codes, params, _threads())
    return codes, params
  for r0 in range(0, rows, _INT4_ROWS_AT_ONCE):
    part = w[r0:r0 + _INT4_ROWS_AT_ONCE].astype(np.float32)
    codes[r0:r0 + len(part)], params[r0:r0 + len(part)] = _int4_rows(part)
  return codes, params


# The C++ form of quantize_int4's search (ftjax._ffi.quantize_int4(w, codes, params, threads)),
# which the kernels layer installs when it loads the compiled module (ftjax.kernels.quantize;
# utils imports nothing of ftjax). Until then, and where the module is not built, the numpy
# form runs, said once on stderr.
_NATIVE_INT4: list = []
_SAID_NUMPY: list = []


def set_native_int4(fn) -> None:
  """Installs the C++ int4 quantiser (``fn(w, codes, params, threads)``, filling codes and
  params in place); None removes it."""
  _NATIVE_INT4[:] = [fn]


def native_int4_quantiser():
  """The installed C++ int4 quantiser (``fn(w, codes, params, threads)``), or None."""
  return _NATIVE_INT4[0] if _NATIVE_INT4 else None


def _native_int4():
  fn = native_int4_quantiser()
  if fn is None and not _SAID_NUMPY:
    print("ftjax: the compiled module's int4 quantiser is not loaded (import ftjax.kernels; "
          "or the build is missing): int4 quantisation runs in numpy, about 5x slower a core",
          file=sys.stderr)
    _SAID_NUMPY.append(True)
  return fn


def _threads() -> int:
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except AttributeError:
    return max(1, os.cpu_count() or 1)


def int4_parts(params: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The parameters ``[..., 8 + 2·B]`` of int4 rows as (d, dm float32 [...], s uint8 [..., B],
  m int8 [..., B])."""
  params = np.ascontiguousarray(params)
  blocks = (params.shape[-1] - 8) // 2
  steps = params[..., :8].copy().view("<f4")
  return (steps[..., 0], steps[..., 1], params[..., 8:8 + blocks],
          params[..., 8 + blocks:].view(np.int8))


def dequantize_int4(codes: np.ndarray, params: np.ndarray, dtype=np.float64) -> np.ndarray:
  """The weights ``[R, C]`` of int4 rows: float32(d·s·q + dm·m) (the layout above; exact
  float32 values), as ``dtype``."""
  codes = np.asarray(codes)
  rows, half = codes.shape
  q = np.stack([codes & 15, codes >> 4], axis=-1).reshape(rows, 2 * half).astype(np.float64)
  d, dm, s, m = int4_parts(np.asarray(params))
  scale = np.repeat(d.astype(np.float64)[:, None] * s.astype(np.float64), INT4_BLOCK, axis=1)
  offset = np.repeat(dm.astype(np.float64)[:, None] * m.astype(np.float64), INT4_BLOCK, axis=1)
  return (scale * q + offset).astype(np.float32).astype(dtype)


# -- int4 expert blocks ----------------------------------------------------------------------------
#
# An int4 expert block (expert format "int4"; the bank is uint16 words, so that its dtype names
# its format as every bank's does: P words = 2·P bytes) holds the codes of gate [F, D/2], up
# [F, D/2] and down [D, F/2] bytes from byte 0 (as mxfp4), then from the 64-aligned byte
# ``int4_offsets(F, D)["params"]["gate"]`` the parameters of every row (int4_param_bytes(D) for
# gate and up rows, int4_param_bytes(F) for down rows), gate, up, down. No biases.

def check_int4_shape(ffn_dim: int, width: int) -> None:
  if ffn_dim % INT4_BLOCK or width % INT4_BLOCK:
    raise ValueError(f"int4 experts need F and D to be multiples of {INT4_BLOCK} (the blocks of "
                     f"32 inputs), got F={ffn_dim}, D={width}: keep these experts in bfloat16 or "
                     "int8")


def int4_offsets(ffn_dim: int, width: int) -> dict[str, dict[str, int]]:
  """Byte offsets in an int4 block: ``{"codes"|"params": {part: offset}}``."""
  f, d = ffn_dim, width
  fd = f * d
  params = _align(3 * fd // 2)
  return {"codes": {"gate": 0, "up": fd // 2, "down": fd},
          "params": {"gate": params, "up": params + f * int4_param_bytes(d),
                     "down": params + 2 * f * int4_param_bytes(d)}}


def int4_block_bytes(ffn_dim: int, width: int) -> int:
  """Bytes of an int4 block's content (codes and row parameters), before padding."""
  check_int4_shape(ffn_dim, width)
  return int4_offsets(ffn_dim, width)["params"]["down"] + width * int4_param_bytes(ffn_dim)


def int4_part(block: np.ndarray, ffn_dim: int, width: int, part: str) -> tuple[np.ndarray,
                                                                             np.ndarray]:
  """``(codes [rows, n/2], params [rows, 8 + n/16])`` (uint8) of ``part`` of one int4 block
  (any uint8 or uint16 view of its bytes)."""
  raw = np.ascontiguousarray(block).view(np.uint8).reshape(-1)
  f, d = ffn_dim, width
  rows, n = (d, f) if part == "down" else (f, d)
  at = int4_offsets(f, d)
  c0, p0 = at["codes"][part], at["params"][part]
  return (raw[c0:c0 + rows * n // 2].reshape(rows, n // 2),
          raw[p0:p0 + rows * int4_param_bytes(n)].reshape(rows, int4_param_bytes(n)))


def quantize_int4_bank(bank: np.ndarray, ffn_dim: int, width: int,
                       block_bytes: int | None = None) -> np.ndarray:
  """A float bank ``[L, E, P]`` (blocks ``gate | up | down``) as an int4 bank
  ``[L, E, block_bytes / 2]`` uint16 (default: the content rounded up to 64 bytes), each weight
  by ``quantize_int4``."""
  bank = np.asarray(bank)
  f, d = ffn_dim, width
  fd = f * d
  at = int4_offsets(f, d)
  block_bytes = block_bytes or _align(int4_block_bytes(f, d))
  out = np.zeros((*bank.shape[:2], block_bytes), np.uint8)
  shapes = {"gate": (0, (f, d)), "up": (fd, (f, d)), "down": (2 * fd, (d, f))}
  for layer in range(bank.shape[0]):
    for expert in range(bank.shape[1]):
      block, dst = bank[layer, expert], out[layer, expert]
      for part, (start, shape) in shapes.items():
        codes, params = quantize_int4(block[start:start + fd].reshape(shape))
        dst[at["codes"][part]:at["codes"][part] + codes.size] = codes.ravel()
        dst[at["params"][part]:at["params"][part] + params.size] = params.ravel()
  return out.view(np.uint16)
