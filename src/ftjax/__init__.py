"""ftjax: serve Mixture-of-Experts models larger than accelerator memory with JAX/XLA.

Stable public API::

  ftjax.convert_hf(hf_dir, out_dir, dtype="bfloat16") -> path
  ftjax.load(path) -> Model            # model.config.num_layers, num_experts, top_k, ...
  ftjax.Engine(model, **runtime_options)
      .forward_logits(token_ids) -> np.ndarray [T, V] float32
      .generate(token_ids, max_new_tokens, greedy=True, ...) -> list[int]
  ftjax.Session(engine, anchor_budget_bytes=..., anchor_tokens=...)   # one conversation
      .set_context(token_ids) -> ContextResult   # reuses the common prefix (KV, anchors)
      .generate(max_new_tokens, greedy=True, ...) -> list[int]
      .tokens, .stats(), .save(directory, wait=True)
  ftjax.Session.restore(engine, directory) -> Session
"""

from ftjax.formats.hf import convert_hf
from ftjax.model.config import ModelConfig
from ftjax.runtime.engine import Engine
from ftjax.runtime.options import RuntimeOptions
from ftjax.runtime.model import Model, load
from ftjax.runtime.checkpoint import CheckpointError
from ftjax.runtime.session import ContextResult, Session

__all__ = ["convert_hf", "load", "Engine", "Model", "ModelConfig", "RuntimeOptions", "Session",
           "ContextResult", "CheckpointError"]
__version__ = "0.1.0"
