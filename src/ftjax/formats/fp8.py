"""Block-scaled FP8 checkpoints, read as float32 one tensor at a time.

Qwen, DeepSeek, MiniMax and Kimi ship FP8 checkpoints whose config.json holds
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}`` (transformers' ``FineGrainedFP8Config``; ``fmt`` is
written by DeepSeek and Qwen, not by transformers). Each quantised linear weight ``X.weight``
is float8_e4m3fn ``[out, in]`` with a float32 companion ``X.weight_scale_inv``
``[ceil(out / bm), ceil(in / bn)]`` for ``weight_block_size = [bm, bn]``; a tensor whose name
does not end in ``.weight`` (fused experts ``mlp.experts.gate_up_proj`` [E, 2F, D]) has
``X_scale_inv`` ``[E, ceil(2F / bm), ceil(D / bn)]``. The real weight is

    w[i, j] = weight[i, j] * weight_scale_inv[i // bm, j // bn]

where the last row and column blocks may be partial. This is transformers' convention
(5.25, ``integrations/finegrained_fp8.py``): ``FP8Linear`` allocates ``weight_scale_inv`` with
``(out_features + block_size[0] - 1) // block_size[0]`` rows and the matching columns;
``_dequantize_fp8_weight`` expands the scales with ``repeat_interleave(block_size[0], dim=-2)
[..., :rows, :]`` and multiplies each ``block_size[1]``-column block (a partial last one too)
by its scale; ``Fp8Quantize`` writes ``weight_scale_inv = max|block| / 448`` (1 for an all-zero
block) and names it ``key[:-len(".weight")] + ".weight_scale_inv"``, or ``key + "_scale_inv"``
for other keys. Its load-time dequantiser ``Fp8Dequantize`` multiplies in float32
(``quantized.to(float32) * scales.to(float32)``) and then casts to the model's dtype; it takes
the block from the scale grid (``rows // scale_rows``) and refuses weights whose shape the grid
does not divide, so it cannot read partial blocks, which ``FP8Linear`` and this module do.

Tensors the checkpoint keeps in bf16 (norms, embeddings, router gates, often ``lm_head``: the
config's ``modules_to_not_convert``) are read as they are; which tensors are FP8 is read from
each tensor's dtype, so that list is not needed. Every FP8 weight is multiplied by its scales
here, in float32 as transformers does: the product of an e4m3 value (4 significant bits) and a
float32 scale (24) needs up to 28 bits, so it is the correctly rounded float32 product, the
value transformers computes, not always the exact one. The converter then stores it as it
stores any float32 tensor (cast, or quantised as ``expert_dtype`` asks).

Streaming: ``get`` of a 2-D FP8 weight returns its float32 dequantisation (one tensor); a
weight with leading axes (fused experts [E, out, in]) returns ``PerExpert``, which dequantises
one expert each time it is indexed, so peak memory stays one expert's float32 weight plus the
mapped source. The ``*_scale_inv`` tensors are consumed and not listed by ``keys``.

Refused, with the fix named: other formats (``fmt`` e5m2, E5M2 tensors), per-tensor or
per-channel scales (``weight_block_size`` null, ``X.weight_scale`` without ``_inv``),
power-of-two UE8M0 scales (``scale_fmt: "ue8m0"``, F8_E8M0 tensors), FP4-packed experts
(``expert_dtype: "fp4"``), static activation scales (``activation_scheme: "static"``,
``input_scale`` or ``activation_scale`` tensors), a block size the scale shapes contradict,
missing scales, scales of a weight that is not FP8, and float8 tensors in a checkpoint whose
``quant_method`` is not ``"fp8"``. Other quantisation methods (compressed-tensors, gptq, awq,
bitsandbytes, fbgemm_fp8, ...) are refused by ``ftjax.formats.hf.convert_hf`` before this
module is reached.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ftjax.formats.safetensors import SafetensorsFile

FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")  # all exact in float32
_DEQUANTISE_FIX = ("dequantise it with transformers (from_pretrained with "
                   "quantization_config=FineGrainedFP8Config(dequantize=True), then "
                   "save_pretrained) and convert that bf16 copy")


class FP8Error(ValueError):
  """An FP8 checkpoint in a layout ftjax does not read; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class FP8Format:
  """The block of one scale: ``block_rows`` outputs by ``block_cols`` inputs."""
  block_rows: int
  block_cols: int


def scale_name(name: str) -> str:
  """The name of a weight's block scales, as transformers' ``Fp8Quantize`` writes it."""
  if name.endswith(".weight"):
    return name[:-len(".weight")] + ".weight_scale_inv"
  return name + "_scale_inv"


def _weight_name(scale: str) -> str:
  """The weight that ``scale`` (a ``*_scale_inv`` name) belongs to; inverts ``scale_name``."""
  return scale[:-len("_scale_inv")]


def fp8_format(hf_dir: str, hf_config: dict[str, Any]) -> FP8Format | None:
  """The block size of a ``quant_method: "fp8"`` checkpoint (None for any other); raises
  ``FP8Error`` for FP8 variants ftjax does not read."""
  q = hf_config.get("quantization_config") or {}
  if q.get("quant_method") != "fp8":
    return None
  field = f"{hf_dir}: quantization_config"
  fmt = q.get("fmt", "e4m3")
  if fmt != "e4m3":
    raise FP8Error(f"{field}.fmt={fmt!r}: ftjax reads FP8 weights in e4m3 (float8_e4m3fn) "
                   f"only; {_DEQUANTISE_FIX}")
  scheme = str(q.get("activation_scheme", "dynamic")).lower()
  if scheme != "dynamic":
    raise FP8Error(f"{field}.activation_scheme={scheme!r}: static input scales are not "
                   "supported (ftjax reads 'dynamic' FP8 checkpoints, whose activations "
                   f"carry no scales); {_DEQUANTISE_FIX}")
  if q.get("scale_fmt", "float") != "float":
    raise FP8Error(f"{field}.scale_fmt={q['scale_fmt']!r}: ftjax reads float32 block scales "
                   f"(scale_fmt 'float'), not power-of-two UE8M0 ones; {_DEQUANTISE_FIX}")
  if q.get("expert_dtype", "fp8") != "fp8":
    raise FP8Error(f"{field}.expert_dtype={q['expert_dtype']!r}: ftjax reads FP8 experts only, "
                   f"not FP4-packed ones; {_DEQUANTISE_FIX}")
  block = q.get("weight_block_size")
  if block is None:
    raise FP8Error(f"{field} has no weight_block_size: per-tensor FP8 scales are not supported "
                   f"(ftjax reads block-scaled FP8, e.g. [128, 128]); {_DEQUANTISE_FIX}")
  if (not isinstance(block, (list, tuple)) or len(block) != 2
      or not all(isinstance(b, int) and b > 0 for b in block)):
    raise FP8Error(f"{field}.weight_block_size={block!r} is not two positive integers "
                   "[rows, columns]; fix config.json")
  return FP8Format(block[0], block[1])


def dequantise(weight: np.ndarray, scale_inv: np.ndarray, fmt: FP8Format) -> np.ndarray:
  """``weight[..., i, j] * scale_inv[..., i // bm, j // bn]`` in float32 (module docstring);
  besides the result, one row of expanded scales is allocated at a time."""
  rows, cols = weight.shape[-2:]
  bm, bn = fmt.block_rows, fmt.block_cols
  out = np.asarray(weight).astype(np.float32)
  scale_inv = np.asarray(scale_inv, np.float32)
  for i in range(scale_inv.shape[-2]):
    row = np.repeat(scale_inv[..., i, :], bn, axis=-1)[..., None, :cols]  # [..., 1, in]
    out[..., i * bm:(i + 1) * bm, :] *= row
  return out


class PerExpert:
  """An FP8 weight with leading axes (fused experts [E, out, in]) that dequantises only the
  expert it is indexed with: ``w[e]`` and ``w[e, rows]`` are float32 arrays."""

  def __init__(self, weight: np.ndarray, scale_inv: np.ndarray, fmt: FP8Format):
    self._weight, self._scale_inv, self._fmt = weight, scale_inv, fmt
    self.shape = tuple(weight.shape)
    self.ndim = len(self.shape)
    self.dtype = np.dtype(np.float32)
    self.nbytes = int(np.prod(self.shape)) * 4

  def __getitem__(self, key):
    first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
    if not isinstance(first, (int, np.integer)):
      return np.asarray(self)[key]  # not used by the converter, which indexes by expert
    expert = dequantise(self._weight[first], self._scale_inv[first], self._fmt)
    return expert[rest] if rest else expert

  def reshape(self, *shape) -> np.ndarray:
    """The whole tensor dequantised (a dense FP8 tensor with more than two axes)."""
    return np.asarray(self).reshape(*shape)

  def __array__(self, dtype=None, copy=None):
    out = dequantise(self._weight, self._scale_inv, self._fmt)
    return out if dtype is None else out.astype(dtype)


class DequantisingShard:
  """One shard of an FP8 checkpoint, seen as float: ``keys`` without the ``*_scale_inv``
  tensors, ``get`` of an FP8 weight dequantised with its scales (read from any shard), and
  ``nbytes`` the size ``get`` returns (float32 for FP8 weights)."""

  def __init__(self, st: SafetensorsFile, fmt: FP8Format, scales: dict[str, SafetensorsFile]):
    self._st, self._fmt, self._scales = st, fmt, scales
    self.path = st.path

  def keys(self) -> list[str]:
    return [n for n in self._st.keys() if not n.endswith("_scale_inv")]

  def shape(self, name: str) -> tuple[int, ...]:
    return self._st.shape(name)

  def nbytes(self, name: str) -> int:
    if self._st.dtype(name) == FP8_DTYPE:
      return int(np.prod(self._st.shape(name))) * 4
    return self._st.nbytes(name)

  def get(self, name: str):
    if self._st.dtype(name) != FP8_DTYPE:
      return self._st.get(name)
    scale = scale_name(name)
    weight, scale_inv = self._st.get(name), self._scales[scale].get(scale)
    if weight.ndim > 2:
      return PerExpert(weight, scale_inv, self._fmt)
    return dequantise(weight, scale_inv, self._fmt)


def _check_tensors(hf_dir: str, fmt: FP8Format, where: dict[str, SafetensorsFile]) -> None:
  """Every FP8 weight has float scales of the shape its block size implies, and every scale
  belongs to an FP8 weight."""
  bm, bn = fmt.block_rows, fmt.block_cols
  # Weights first: a weight in the wrong format is named as such, not as its scale's orphan.
  for name in sorted(where, key=lambda n: n.endswith("_scale_inv")):
    st, dtype = where[name], where[name].dtype(name)
    if name.endswith(("input_scale", "activation_scale")):
      raise FP8Error(f"{hf_dir}: tensor {name} is a static activation scale, which ftjax does "
                     f"not apply (it reads 'dynamic' FP8 checkpoints); {_DEQUANTISE_FIX}")
    if name.endswith("_scale_inv"):
      weight = _weight_name(name)
      if weight not in where or where[weight].dtype(weight) != FP8_DTYPE:
        found = f"is {where[weight].dtype(weight)}" if weight in where else "is missing"
        raise FP8Error(f"{hf_dir}: tensor {name} scales {weight}, which {found}, not FP8 e4m3 "
                       "(F8_E4M3); remove the stray scale or restore the FP8 weight")
      if dtype not in SCALE_DTYPES:
        extra = (" (power-of-two UE8M0 scales, scale_fmt 'ue8m0')" if dtype == "F8_E8M0"
                 else "")
        raise FP8Error(f"{hf_dir}: tensor {name} has dtype {dtype}{extra}; ftjax reads float32 "
                       f"block scales; {_DEQUANTISE_FIX}")
      continue
    if dtype.startswith("F8_") and dtype != FP8_DTYPE:
      raise FP8Error(f"{hf_dir}: tensor {name} is {dtype}; ftjax reads FP8 weights in e4m3 "
                     f"(F8_E4M3) only; {_DEQUANTISE_FIX}")
    if dtype != FP8_DTYPE:
      continue
    shape = st.shape(name)
    scale = scale_name(name)
    if len(shape) < 2:
      raise FP8Error(f"{hf_dir}: FP8 tensor {name} has shape {shape}; block-scaled FP8 weights "
                     "are [out, in] matrices (or stacks of them)")
    if scale not in where:
      per_tensor = name + "_scale"  # X.weight_scale: ModelOpt's, compressed-tensors'
      if per_tensor in where:
        raise FP8Error(f"{hf_dir}: FP8 tensor {name} has a per-tensor or per-channel scale "
                       f"{per_tensor}, not block scales {scale}; ftjax reads block-scaled FP8 "
                       f"(weight_scale_inv per weight_block_size block); {_DEQUANTISE_FIX}")
      raise FP8Error(f"{hf_dir}: FP8 tensor {name} has no block scales {scale}; the checkpoint "
                     "is incomplete (download the shard that holds it again)")
    rows, cols = shape[-2:]
    want = tuple(shape[:-2]) + (-(-rows // bm), -(-cols // bn))
    got = where[scale].shape(scale)
    if tuple(got) != want:
      implied = (f"blocks of about {-(-rows // got[-2])} x {-(-cols // got[-1])}"
                 if len(got) == len(want) and got[-2] and got[-1] else "another layout")
      raise FP8Error(f"{hf_dir}: FP8 tensor {name} {list(shape)} has scales {scale} "
                     f"{list(got)}, but quantization_config.weight_block_size [{bm}, {bn}] "
                     f"gives {list(want)}; the scales imply {implied}: fix weight_block_size in "
                     "config.json")


def dequantising_shards(hf_dir: str, hf_config: dict[str, Any],
                        shards: list[SafetensorsFile]) -> list:
  """``shards`` as the converter reads them: for an FP8 checkpoint (``quant_method: "fp8"``),
  ``DequantisingShard`` views after checking every tensor's name, dtype and scale shape (from
  the headers, without reading data); for any other, the shards themselves, after checking
  they hold no float8 tensor."""
  where = {n: st for st in shards for n in st.keys()}
  fmt = fp8_format(hf_dir, hf_config)
  if fmt is None:
    float8 = next((n for n, st in where.items() if st.dtype(n).startswith("F8_")), None)
    if float8 is not None:
      method = (hf_config.get("quantization_config") or {}).get("quant_method")
      raise FP8Error(f"{hf_dir}: tensor {float8} is {where[float8].dtype(float8)} but "
                     f"config.json's quantization_config.quant_method is {method!r}, not 'fp8'; "
                     "restore the checkpoint's quantization_config")
    return shards
  _check_tensors(hf_dir, fmt, where)
  scales = {n: st for n, st in where.items() if n.endswith("_scale_inv")}
  return [DequantisingShard(st, fmt, scales) for st in shards]

