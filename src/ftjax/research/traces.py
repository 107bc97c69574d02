"""Routing traces: which experts the router chose, per token and layer.

A ``Trace`` holds ``ids`` and ``weights`` shaped ``[steps, layers, top_k]`` (one step = one
routed token; -1 marks an absent route), the number of experts per layer, a phase per step
(0 prefill, 1 decode), free-form metadata (model config, source) and, optionally,
``predicted [steps, layers, P]``: experts a predictor named each layer-step before it ran
(e.g. router-ahead: the layer's router on an earlier hidden state), -1 for none, which the
replay's ``Prefetch(predictor="trace")`` prefetches. Capture one with
``ftjax.Engine(model, record_routing=True)`` and ``Trace.from_engine(engine)``; replay it
through the cache policies with ``ftjax.research.sweep.replay``.

File format (``save``/``load``): a NumPy ``.npz`` with arrays ``ids`` (int32), ``weights``
(float32), ``phase`` (uint8), ``predicted`` (int32, when present) and a UTF-8 JSON string
``meta`` holding ``format``
("ftjax-trace"), ``format_version`` (1), ``num_experts`` and ``metadata``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

FORMAT = "ftjax-trace"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
  ids: np.ndarray  # [S, L, K] int32, -1 = no route
  weights: np.ndarray  # [S, L, K] float32
  num_experts: int
  phase: np.ndarray  # [S] uint8: 0 prefill, 1 decode
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
  predicted: np.ndarray | None = None  # [S, L, P] int32, -1 = no prediction

  @property
  def num_steps(self) -> int:
    return self.ids.shape[0]

  @property
  def num_layers(self) -> int:
    return self.ids.shape[1]

  @property
  def top_k(self) -> int:
    return self.ids.shape[2]

  @classmethod
  def from_arrays(cls, ids, weights, num_experts: int, *, phase=None,
                  metadata: dict[str, Any] | None = None, predicted=None) -> "Trace":
    """Builds and validates a trace; ``ids``/``weights`` are ``[steps, layers, top_k]``,
    ``predicted`` (optional) ``[steps, layers, P]``."""
    ids = np.asarray(ids)
    weights = np.asarray(weights, np.float32)
    if ids.ndim != 3:
      raise ValueError(f"ids must be [steps, layers, top_k], got shape {ids.shape}")
    if weights.shape != ids.shape:
      raise ValueError(f"weights must have the shape of ids {ids.shape}, got {weights.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"ids must be integers, got {ids.dtype}")
    if num_experts < 1:
      raise ValueError(f"num_experts must be positive, got {num_experts}")
    if ids.size and (ids.min() < -1 or ids.max() >= num_experts):
      raise ValueError(f"ids must be in [-1, {num_experts}); got min {ids.min()}, max "
                       f"{ids.max()}")
    phase = (np.ones(ids.shape[0], np.uint8) if phase is None
             else np.asarray(phase, np.uint8).reshape(-1))
    if phase.shape != (ids.shape[0],):
      raise ValueError(f"phase must have one entry per step ({ids.shape[0]}), got {phase.shape}")
    if predicted is not None:
      predicted = np.asarray(predicted)
      if (predicted.ndim != 3 or predicted.shape[:2] != ids.shape[:2] or
          not np.issubdtype(predicted.dtype, np.integer)):
        raise ValueError(f"predicted must be integers [steps, layers, P] with the steps and "
                         f"layers of ids {ids.shape[:2]}, got {predicted.dtype} "
                         f"{predicted.shape}")
      if predicted.size and (predicted.min() < -1 or predicted.max() >= num_experts):
        raise ValueError(f"predicted ids must be in [-1, {num_experts})")
      predicted = predicted.astype(np.int32)
    return cls(ids=ids.astype(np.int32), weights=weights, num_experts=int(num_experts),
               phase=phase, metadata=dict(metadata or {}), predicted=predicted)

  @classmethod
  def from_engine(cls, engine) -> "Trace":
    """Every token an ``ftjax.Engine`` created with ``record_routing=True`` has routed so
    far (``engine.routing_record()``), with the model config, its expert format and source as
    metadata."""
    record = engine.routing_record()
    c = engine.model.config
    return cls.from_arrays(record["ids"], record["weights"], c.num_experts,
                           phase=record["phase"],
                           metadata={"model_config": c.to_dict(), "source": engine.model.path,
                                     "expert_format": engine.model.expert_format})

  def save(self, path: str | os.PathLike) -> str:
    path = os.fspath(path)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "num_experts": self.num_experts,
            "metadata": self.metadata}
    extra = {} if self.predicted is None else {"predicted": self.predicted}
    with open(path, "wb") as f:
      np.savez_compressed(f, ids=self.ids, weights=self.weights, phase=self.phase,
                          meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **extra)
    return path

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Trace":
    if not os.path.isfile(path):
      raise FileNotFoundError(f"trace {path} not found")
    try:
      with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        ids, weights, phase = z["ids"], z["weights"], z["phase"]
        predicted = z["predicted"] if "predicted" in z.files else None
    except (ValueError, KeyError, OSError) as e:
      raise ValueError(f"{path} is not an ftjax trace file ({e})") from e
    if meta.get("format") != FORMAT:
      raise ValueError(f"{path} is not an ftjax trace file")
    if meta.get("format_version", 0) > FORMAT_VERSION:
      raise ValueError(f"{path} uses trace format {meta['format_version']}, newer than the "
                       f"{FORMAT_VERSION} this ftjax reads: upgrade ftjax")
    return cls.from_arrays(ids, weights, meta["num_experts"], phase=phase,
                           metadata=meta.get("metadata"), predicted=predicted)
