"""Session checkpoints with orbax: a directory of steps, each a complete snapshot.

``write(directory, arrays, meta)`` saves one step through an ``orbax.checkpoint``
``CheckpointManager``: the step is written under a temporary name and renamed when complete,
so a process killed mid-save leaves the previous step as the newest complete one (orbax
ignores unfinished steps). The previous step is deleted only after the new one is committed
(``max_to_keep=2``). ``read(directory)`` returns the newest complete step's arrays and meta.

Every array's CRC-32 goes in the meta and is checked on read, and the meta records a
fingerprint of the model (``model_fingerprint``), so a corrupt checkpoint or one from another
model is an error, never a wrong state.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ftjax.kernels.cpu_info import ftjax_version

FORMAT = "ftjax-session"
FORMAT_VERSION = 1


def writer_version() -> str:
  """The ftjax version a session's meta records (``ftjax_version``), which a session store
  compares with its own."""
  return ftjax_version()


class CheckpointError(ValueError):
  """A session checkpoint that cannot be restored: missing, unfinished, corrupt, or from
  another model or format."""


def model_fingerprint(model) -> str:
  """A hex digest naming a model's weights and config: for an FTW model, its config and the
  CRC-32 of every tensor and expert layer in its index (no weight is read); otherwise (models
  built in memory) the config and the bytes of every weight."""
  h = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode())
  if model.storage is not None:
    index = model.storage.index
    h.update(json.dumps({name: t["crc32"] for name, t in sorted(index["tensors"].items())},
                        sort_keys=True).encode())
    h.update(json.dumps(index["experts"].get("layer_crc32")).encode())
  else:
    for leaf in jax.tree.leaves(model.params) + [model.bank]:
      h.update(np.ascontiguousarray(np.asarray(leaf)).view(np.uint8).tobytes())
  return h.hexdigest()[:32]


def _flat(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}/"))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _crc(array: np.ndarray) -> int:
  return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).tobytes())


class Writer:
  """Saves steps into one directory; ``asynchronous`` returns from ``save`` once the arrays
  are handed over, and ``wait`` blocks until the last save is committed."""

  def __init__(self, directory: str, *, asynchronous: bool = False):
    self.directory = os.path.abspath(directory)
    self.asynchronous = asynchronous
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=asynchronous, create=True))

  def save(self, arrays: dict, meta: dict[str, Any]) -> int:
    """Saves a new step (one more than the newest); returns its number."""
    self._manager.wait_until_finished()  # one save at a time, in order
    latest = self._manager.latest_step()
    step = 0 if latest is None else latest + 1
    meta = dict(meta, format=FORMAT, format_version=FORMAT_VERSION,
                crc32={k: _crc(v) for k, v in _flat(arrays).items()})
    self._manager.save(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)))
    if not self.asynchronous:
      self._manager.wait_until_finished()
    return step

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def _meta(manager, path: str) -> tuple[dict[str, Any], int]:
  step = manager.latest_step()
  if step is None:
    raise CheckpointError(
        f"{path} holds no complete session checkpoint (a save that was interrupted leaves "
        "none behind): save the session there again")
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  except Exception as e:  # orbax raises many kinds for damaged files
    raise CheckpointError(f"the session checkpoint {path} (step {step}) is unreadable: {e}; "
                          "it is corrupt: save the session again") from e
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise CheckpointError(f"{path} (step {step}) is not an ftjax session checkpoint")
  if meta.get("format_version") != FORMAT_VERSION:
    raise CheckpointError(
        f"{path} (step {step}) is session checkpoint format {meta.get('format_version')}; "
        f"this ftjax reads format {FORMAT_VERSION}")
  return meta, step


def _manager(directory: str):
  path = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no session checkpoint at {path}: the directory does not exist")
  return path, ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False))


def read_meta(directory: str) -> tuple[dict[str, Any], int]:
  """(meta, step) of the newest complete step in ``directory``, its arrays left unread (their
  CRC-32s are checked by ``read``)."""
  path, manager = _manager(directory)
  try:
    return _meta(manager, path)
  finally:
    manager.close()


def read(directory: str) -> tuple[dict, dict[str, Any], int]:
  """(arrays, meta, step) of the newest complete step in ``directory``."""
  path, manager = _manager(directory)
  try:
    meta, step = _meta(manager, path)
    try:
      arrays = manager.restore(step, args=ocp.args.Composite(
          arrays=ocp.args.StandardRestore())).arrays
    except Exception as e:
      raise CheckpointError(f"the arrays of the session checkpoint {path} (step {step}) are "
                            f"unreadable: {e}; it is corrupt: save the session again") from e
  finally:
    manager.close()
  flat = _flat(arrays)
  expected = meta.get("crc32", {})
  if set(flat) != set(expected):
    raise CheckpointError(f"the session checkpoint {path} (step {step}) is corrupt: it holds "
                          f"arrays {sorted(set(flat) ^ set(expected))[:4]} that its meta does not "
                          "list, or lacks some it lists")
  for name, value in flat.items():
    if _crc(np.asarray(value)) != expected[name]:
      raise CheckpointError(f"the session checkpoint {path} (step {step}) is corrupt: array "
                            f"{name} fails its CRC-32; save the session again")
  return arrays, meta, step
