"""A loaded model: config, nnx graph definition, dense parameters and the expert bank."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ftjax.assets import EMBEDDED_MODELS
from ftjax.formats import ftw
from ftjax.formats.hf import cached_conversion
from ftjax.model.config import ModelConfig
from ftjax.model.layers import LINEAR_OUT_AXES
from ftjax.model.transformer import Transformer, abstract_model, param_name
from ftjax.runtime.programs import available_host_bytes
from ftjax.utils import dense_quant, quant
from ftjax.utils.dense_quant import QuantizedMatrix
from ftjax.utils.progress import Progress


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
  """What ``ftjax.load`` returns. ``bank`` is the host expert pool ``[L, E, P]``: bfloat16 or
  float32 blocks, int8 blocks with their row scales (``expert_format`` ``"int8"``, P in
  bytes), or uint8 mxfp4 blocks (``"mxfp4"``: gpt-oss's MXFP4 codes, scales and biases;
  ``ftjax.utils.quant``)."""
  config: ModelConfig
  graphdef: nnx.GraphDef
  params: nnx.State
  bank: jax.Array
  path: str | None = None
  source: dict[str, Any] | None = None
  storage: ftw.FTWFile | None = None  # the FTW file the arrays view (mapped or copied)

  @property
  def dtype(self) -> np.dtype:
    """The storage dtype of the dense weights (and of the experts unless they are quantised)."""
    if self.expert_format in quant.QUANTISED_EXPERT_FORMATS:
      return np.dtype(leaf(self, "final_norm.scale").dtype)  # never quantised
    return np.dtype(self.bank.dtype)

  @property
  def dense_formats(self) -> dict[str, int]:
    """How many dense parameters each format holds (``{"bfloat16": 50, "mxfp4": 24}``)."""
    counts: dict[str, int] = {}
    for value in _values(self).values():
      fmt = value.format if isinstance(value, QuantizedMatrix) else str(np.dtype(value.dtype))
      counts[fmt] = counts.get(fmt, 0) + 1
    return counts

  @property
  def expert_format(self) -> str:
    """The bank's expert format: ``"bfloat16"``, ``"float32"``, ``"int8"``, ``"mxfp4"`` or
    ``"int4"`` (uint16 words)."""
    dtype = np.dtype(self.bank.dtype)
    return {np.dtype(np.int8): "int8", np.dtype(np.uint8): "mxfp4",
            np.dtype(np.uint16): "int4"}.get(dtype, str(dtype))

  @property
  def expert_bytes(self) -> int:
    """Bytes one expert's content takes (weights and scales, no padding)."""
    return ftw.expert_content_bytes(self.config, self.expert_format)


LOAD_MODES = ("auto", "copy", "mmap")
LOAD_MODES_HELP = ("how the weights are held: copy (read into this process's memory: the same "
                   "bytes read up to 1.8x faster than the files' mapped pages on some "
                   "machines), mmap (views of the memory-mapped files: nothing copied, "
                   "pages come from the page cache as read), or auto (copy when the copy and "
                   "the files' cached pages together take at most 80% of the memory "
                   "available, mmap otherwise)")
COPY_HEADROOM = 0.8


def fits_in_memory(nbytes: int, headroom: float = COPY_HEADROOM) -> bool:
  """Whether ``nbytes`` take at most ``headroom`` of the memory available now (True where
  /proc/meminfo does not say)."""
  available = available_host_bytes()
  return available is None or nbytes <= headroom * available


def copy_fits(nbytes: int, headroom: float = COPY_HEADROOM) -> bool:
  """Whether ``load_mode="auto"`` copies ``nbytes`` of files: when the copy and the files'
  pages in the page cache (which the copy reads, and which a later start reads again) fit
  together, ``2 * nbytes``, in ``headroom`` of the memory available. A copy that does not
  fit beside them evicts the files as it reads them: the full-size gpt-oss-20b-shaped model
  (13.8 GB on 24 GB) then took 15.4 s to its first token from a warm page cache, against
  7.7 s mapped, and left the next start cold."""
  return fits_in_memory(2 * nbytes, headroom)


def residency(model: Model) -> str:
  """A line that says how ``model``'s weights are held (``load_mode``), for the CLIs' stderr."""
  storage = model.storage
  if storage is None:
    return "ftjax: the weights are in memory already (no file behind them)"
  nbytes = storage.mapped_bytes()
  if storage.residency == "copied":
    return (f"ftjax: copied the weights ({nbytes / 1e9:.2f} GB) into memory in "
            f"{storage.copy_s:.1f} s (--load_mode=mmap maps the files instead)")
  return f"ftjax: the weights ({nbytes / 1e9:.2f} GB) are mapped from their files"


def prefault(model: Model, *, headroom: float = COPY_HEADROOM) -> str:
  """Faults the model's memory-mapped weights into this process before its first step, when
  they take at most ``headroom`` of the memory available, and returns a line that says what it
  did. A fresh process otherwise takes a page fault for every 4 KiB page the first time a step
  reads it: on the 4-layer Qwen3-30B-A3B-shaped bench model (5.4 GB) that slowed the first 64
  decode tokens of ``python -m ftjax.decode`` below the benchmarks' workers, which pre-fault
  (issue 34). The pages come from the page cache (or the disk, the first time)."""
  if model.storage is None or model.storage.residency == "copied":
    return residency(model)
  nbytes = model.storage.mapped_bytes()
  if not fits_in_memory(nbytes, headroom):
    return (f"ftjax: not pre-faulting the weights: {nbytes / 1e9:.1f} GB mapped, "
            f"{available_host_bytes() / 1e9:.1f} GB available; the first steps fault them in as they read "
            "them (--noprefault silences this)")
  t0 = time.perf_counter()
  model.storage.populate()
  return (f"ftjax: pre-faulted the weights ({nbytes / 1e9:.2f} GB mapped) in "
          f"{time.perf_counter() - t0:.1f} s, so that decode reads resident pages from its "
          "first step (--noprefault skips this)")


def _assemble(config: ModelConfig, arrays: dict[str, Any], bank, *, dtype=jnp.float32,
              **fields) -> Model:
  """Builds a Model from parameter arrays keyed by name, checking names and shapes."""
  graphdef, state = nnx.split(abstract_model(config, dtype))
  flat = nnx.to_flat_state(state)
  expected = {param_name(p) for p, _ in flat}
  extra, missing = sorted(set(arrays) - expected), sorted(expected - set(arrays))
  if extra or missing:
    raise ftw.FTWConfigMismatchError(
        f"parameters do not match the model config: missing {missing[:5]}, unexpected {extra[:5]}")
  leaves = []
  for p, var in flat:
    name = param_name(p)
    value = arrays[name]
    if tuple(value.shape) != tuple(var.get_value().shape):
      raise ftw.FTWConfigMismatchError(
          f"parameter {name} has shape {tuple(value.shape)} but the model config implies "
          f"{tuple(var.get_value().shape)}")
    leaves.append((p, var.replace(value=value)))
  params = nnx.from_flat_state(leaves)
  return Model(config=config, graphdef=graphdef, params=params, bank=bank, **fields)


def load(path: str | os.PathLike, *, verify: bool | str = "once", populate: bool = False,
         load_mode: str = "auto", show_progress: bool = False) -> Model:
  """Loads an FTW directory, a Hugging Face checkpoint directory (converted once, cached), or
  an embedded model by name: ``"default"`` or ``"default-hybrid"``
  (``ftjax.assets.EMBEDDED_MODELS``).

  ``load_mode`` (``LOAD_MODES_HELP``): ``"copy"`` reads the files into this process's memory
  (``FTWFile.copy_to_memory``), ``"mmap"`` maps them, ``"auto"`` copies when the copy and the
  files' cached pages take at most 80% of the memory available (``MemAvailable``, ``copy_fits``)
  and maps them otherwise;
  ``model.storage.residency`` says which ("copied" or "mapped") and ``residency(model)`` in a
  line. On the CPU backend the dense tensors and the expert bank are zero-copy views of those
  buffers; on an accelerator the bank stays a numpy view, placed by the engine
  (``RuntimeOptions.pool``). ``verify``: ``"once"`` checks every CRC-32 (which also reads
  every page) the first time these files are loaded on this machine and skips the check while
  they stay unchanged (``FTWFile.open``); True checks every time, False never. ``populate``
  faults every mapped page in without checking, for timing with resident weights (copied
  weights are resident already). ``show_progress``: a progress bar on stderr while copying.
  """
  if load_mode not in LOAD_MODES:
    raise ValueError(f"load_mode must be one of {', '.join(LOAD_MODES)}, got {load_mode!r}")
  path = os.fspath(path)
  if path in EMBEDDED_MODELS and not os.path.exists(path):
    name, path = path, EMBEDDED_MODELS[path]
    if not ftw.is_ftw_dir(path):
      raise FileNotFoundError(
          f"the embedded model {name!r} is missing from this installation ({path}); reinstall "
          "ftjax, or train it with python -m ftjax.tiny.train")
  if not os.path.isdir(path):
    raise FileNotFoundError(
        f"model path {path} does not exist or is not a directory (embedded models: "
        f"{', '.join(EMBEDDED_MODELS)})")
  if not ftw.is_ftw_dir(path):
    if os.path.isfile(os.path.join(path, "config.json")):
      path = cached_conversion(path)
    else:
      raise FileNotFoundError(
          f"{path} is neither an FTW directory (no {ftw.INDEX_NAME}) nor a Hugging Face "
          "checkpoint (no config.json)")
  f = ftw.FTWFile.open(path, verify=verify)
  nbytes = f.mapped_bytes()
  if load_mode == "copy" or (load_mode == "auto" and copy_fits(nbytes)):
    bar = Progress(nbytes, desc="ftjax: copying the weights into memory", unit="B",
                   enabled=show_progress and nbytes >= 1 << 30)
    try:
      f.copy_to_memory(bar.update)
    finally:
      bar.close()
  elif populate:
    f.populate()
  arrays = {name: jax.device_put(f.tensor(name)) for name in f.tensor_names()}
  bank = f.expert_bank()
  if jax.default_backend() == "cpu":
    bank = jax.device_put(bank)  # zero-copy view of the mapped or copied file
  # On an accelerator the bank stays the host mapping: the engine places it (pool=, see
  # ftjax.runtime.placement), so a pool larger than device memory never goes there whole.
  return _assemble(f.config, arrays, bank, path=path, source=f.index.get("source"), storage=f)


def random_model(config: ModelConfig, *, seed: int = 0, dtype: str = "float32") -> Model:
  """A deterministic random-initialised model (tests, the untrained default model)."""
  np_dtype = ftw.storage_dtype(dtype)
  model = Transformer(config, rngs=nnx.Rngs(seed), dtype=jnp.dtype(np_dtype))
  graphdef, params = nnx.split(model)
  c = config
  bank_shape = (c.num_moe_layers, c.num_experts,
                ftw.align(c.expert_block_elems * np_dtype.itemsize) // np_dtype.itemsize)
  key = jax.random.fold_in(jax.random.key(seed), 1)
  bank = 0.02 * jax.random.normal(key, bank_shape, jnp.float32)
  bank = bank.at[..., c.expert_block_elems:].set(0.0).astype(np_dtype)  # zero padding
  return Model(config=config, graphdef=graphdef, params=params, bank=bank)


def with_mtp_head(model: Model, mtp_layers: int = 1, *, seed: int = 0) -> Model:
  """The model with a randomly initialised multi-token-prediction head of ``mtp_layers``
  layers (``Transformer.mtp_step``): every trunk parameter and the trunk's expert bank
  unchanged, the head's routed experts appended as bank layers ``num_layers ..``. The head's
  values are ``random_model``'s float32 initialisation for ``seed`` whatever the model's
  dtype, cast to it. For training a head on a finished model (``python -m ftjax.tiny.train``)
  and for tests."""
  c = model.config
  if c.mtp_layers:
    raise ValueError(f"this model has {c.mtp_layers} MTP layers already")
  if set(model.dense_formats) & set(dense_quant.DENSE_FORMATS):
    raise ValueError("a head is added to a model with float dense weights; this one's are "
                     f"{model.dense_formats}: add the head first, then quantise")
  if model.expert_format in quant.QUANTISED_EXPERT_FORMATS:
    raise ValueError(f"a head is added to float experts; this model's are {model.expert_format}")
  config = dataclasses.replace(c, mtp_layers=mtp_layers)  # validates the family
  dtype = jnp.dtype(model.dtype)
  head = random_model(config, seed=seed, dtype="float32")
  arrays = {n: v.astype(dtype) for n, v in named_params(head).items()}
  arrays.update(named_params(model))
  blocks = head.bank[c.num_moe_layers:, :, :c.expert_block_elems].astype(dtype)
  padding = model.bank.shape[-1] - c.expert_block_elems  # the bank's alignment, zeros
  blocks = jnp.pad(blocks, ((0, 0), (0, 0), (0, padding)))
  bank = jnp.concatenate([jnp.asarray(model.bank), blocks])
  return _assemble(config, arrays, bank, dtype=dtype, source=model.source)


def quantize_experts(model: Model, expert_format: str = "int8") -> Model:
  """The model with its routed experts quantised to ``expert_format`` (``"int8"``, ``"int4"``
  or ``"mxfp4"``; docs/ftw.md, ``ftjax.utils.quant``) in memory,
  dense weights unchanged: the bank that ``save(model, ..., expert_format=...)`` then ``load``
  gives."""
  if model.expert_format in quant.QUANTISED_EXPERT_FORMATS:
    raise ValueError(f"the model's experts are {model.expert_format} already")
  c = model.config
  f, d = c.moe_intermediate_size, c.hidden_size
  if expert_format == "mxfp4":
    bank = quant.quantize_mxfp4_bank(
        np.asarray(model.bank), f, d, bias=c.expert_bias,
        block_bytes=ftw.align(quant.mxfp4_block_bytes(f, d, c.expert_bias)))
  elif expert_format == "int8":
    bank = quant.quantize_bank(np.asarray(model.bank), f, d,
                               block_bytes=ftw.align(quant.int8_block_bytes(f, d)))
  elif expert_format == "int4":
    if c.expert_bias:
      raise ValueError("int4 experts carry no biases: keep this model's experts in mxfp4 or "
                       "bfloat16")
    bank = quant.quantize_int4_bank(np.asarray(model.bank), f, d,
                                    block_bytes=ftw.align(quant.int4_block_bytes(f, d)))
  else:
    raise ValueError(f"expert_format must be 'int8', 'int4' or 'mxfp4', got {expert_format!r}")
  return dataclasses.replace(model, bank=jax.device_put(bank) if jax.default_backend() == "cpu"
                             else bank, path=None, storage=None)


def quantize_dense(model: Model, dense_dtype: str) -> Model:
  """The model with its dense weights quantised as ``--dense_dtype=dense_dtype`` writes them
  (``ftw.dense_format``: int8, int4, mxfp4, or the mixed4 / mixed_int4 presets) in memory,
  experts unchanged: the
  parameters that ``save(model, ..., dense_dtype=...)`` then ``load`` gives."""
  c = model.config
  arrays = {}
  for name, value in _values(model).items():
    if isinstance(value, QuantizedMatrix):
      raise ValueError(f"the model's dense weights are quantised already ({name} is "
                       f"{value.format})")
    fmt, _ = ftw.dense_format(dense_dtype, name, tuple(value.shape), c.tie_word_embeddings)
    if fmt is None:
      arrays[name] = value
      continue
    q = dense_quant.quantize(np.asarray(value), fmt, LINEAR_OUT_AXES[name.rsplit(".", 1)[-1]])
    arrays[name] = jax.device_put(q)
  return _assemble(c, arrays, model.bank, dtype=jnp.dtype(model.dtype), source=model.source)


def dequantize_dense(model: Model) -> Model:
  """The model with every quantised dense weight replaced by its float32 dequantisation
  (exact): the reference a quantised model's results are checked against."""
  arrays = {name: (jnp.asarray(dense_quant.dequantize_np(v, np.float32))
                   if isinstance(v, QuantizedMatrix) else v)
            for name, v in _values(model).items()}
  return _assemble(model.config, arrays, model.bank, dtype=jnp.float32, source=model.source)


def _values(model: Model) -> dict[str, Any]:
  return {param_name(p): v.get_value() for p, v in nnx.to_flat_state(model.params)}


def leaf(model: Model, name: str) -> jax.Array | QuantizedMatrix:
  """One parameter by its FTW name (``layers.0.attn.w_q_had``): an array, or a quantised
  weight's ``QuantizedMatrix``."""
  for p, v in nnx.to_flat_state(model.params):
    if param_name(p) == name:
      return v.get_value()
  raise KeyError(name)


def named_params(model: Model) -> dict[str, np.ndarray | QuantizedMatrix]:
  """Every parameter by its FTW name, as numpy arrays (a quantised weight: its
  ``QuantizedMatrix`` of numpy arrays)."""
  return {name: (dataclasses.replace(v, data=np.asarray(v.data), scales=np.asarray(v.scales))
                 if isinstance(v, QuantizedMatrix) else np.asarray(v))
          for name, v in _values(model).items()}


def save(model: Model, out_dir: str | os.PathLike, *, dtype: str | None = None,
         source: dict[str, Any] | None = None, expert_format: str | None = None,
         dense_dtype: str | None = None) -> str:
  """Writes a Model as an FTW directory (used for the default model and round-trip tests).

  ``dtype`` is the dense tensors' storage dtype; ``expert_format`` the bank's (default: the
  model's own; ``"int8"`` quantises float experts; int8, int4 and mxfp4 experts are written as
  they are and cannot be written back as floats); ``dense_dtype`` quantises float dense weights
  (``ftw.dense_format``; quantised ones are written as they are)."""
  dtype = dtype or str(model.dtype)
  quantised = model.expert_format in quant.QUANTISED_EXPERT_FORMATS
  expert_format = expert_format or (model.expert_format if quantised else dtype)
  if quantised and expert_format != model.expert_format:
    raise ValueError(f"this model's experts are {model.expert_format}; they cannot be saved as "
                     f"{expert_format} (quantisation is one way): save with "
                     f"expert_format={model.expert_format!r}")
  writer = ftw.FTWWriter(out_dir, model.config, dtype, source or model.source or {},
                         expert_format=expert_format, dense_dtype=dense_dtype)
  for name, value in named_params(model).items():
    writer.add_tensor(name, value)
  bank = np.asarray(model.bank)
  c = model.config
  starts = ftw.expert_part_starts(c)
  scales_at = quant.int8_scales_offset(c.moe_intermediate_size, c.hidden_size)
  scale_starts = {"gate": 0, "up": c.moe_intermediate_size, "down": 2 * c.moe_intermediate_size}
  mxfp4 = quant.mxfp4_offsets(c.moe_intermediate_size, c.hidden_size) if (
      model.expert_format == "mxfp4") else None
  for layer in range(bank.shape[0]):
    for expert in range(bank.shape[1]):
      block = bank[layer, expert]
      if model.expert_format == "int4":  # codes with their row parameters, as stored
        for part in ftw.expert_part_shapes(c):
          writer.add_expert_part(layer, expert, part, *quant.int4_part(
              block, c.moe_intermediate_size, c.hidden_size, part))
        continue
      if mxfp4 is not None:  # codes with their scales, float32 biases, as stored
        for part, shape in ftw.expert_part_shapes(c).items():
          if part.endswith("_bias"):
            at = mxfp4["biases"][part[:-len("_bias")]]
            writer.add_expert_part(layer, expert, part,
                                   block[at:at + 4 * shape[0]].view(np.float32))
            continue
          (rows, cols), at, s = shape, mxfp4["codes"][part], mxfp4["scales"][part]
          writer.add_expert_part(
              layer, expert, part, block[at:at + rows * cols // 2].reshape(rows, cols // 2),
              block[s:s + rows * cols // quant.MXFP4_BLOCK].reshape(rows, -1))
        continue
      for part, shape in ftw.expert_part_shapes(c).items():
        start = starts[part]
        n = int(np.prod(shape))
        scale = None
        if model.expert_format == "int8":
          scales = block.view(np.uint8)[scales_at:].view(np.float32)  # P is a multiple of 64
          scale = scales[scale_starts[part]:scale_starts[part] + shape[0]]
        writer.add_expert_part(layer, expert, part, block[start:start + n].reshape(shape), scale)
  return writer.close()
