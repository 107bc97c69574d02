"""Flax (nnx) model definitions for the MoE families ftjax serves.

Axis-letter glossary, used in every einsum string, weight name and shape comment of the
package:

  B batch              T query length        S key/value length
  D model width        F expert hidden width I dense / shared-expert MLP width
  E experts            K top-k               N cache slots
  L layers             H query heads         G key/value heads
  R query heads per key/value head (H = G·R) A attention head width
  V vocabulary         P elements of one padded expert block in the bank
  O output features, C contracted input features (of a generic matrix ``[O, C]``, as in
    ``linear`` and the host GEMV/GEMM; K and N stay top-k and slots)
  Gated DeltaNet (``deltanet.py``): J key heads, M value heads, U key-head width, Y value-head
    width, X conv channels (2·J·U + M·Y), W conv width, Q chunk length, Z chunks
  Multi-head latent attention (``layers.LatentAttention``) reuses letters inside that class
    only: Q query rank, R latent rank, L = R + P a latent cache row, N unrotated and P rotary
    query/key dims per head (C = N + P), V value dims per head

Weights are named by their axes in storage order: ``w_q_had`` is ``[H, A, D]``.

The model owns the per-layer decode state (``DecodeState``) and receives its routed experts as
an argument (``RoutedExperts``, ``ftjax.model.moe``); it imports ``ftjax.kernels`` for its
dense ops only (GEMV/GEMM, attention), never the expert kernels, the cache or the runtime.
"""

from ftjax.model.config import ModelConfig, SUPPORTED_MODEL_TYPES, UnsupportedModelError
from ftjax.model.deltanet import LinearState
from ftjax.model.layers import KV_BITS, kv_stored, kv_values
from ftjax.model.moe import RoutedExperts
from ftjax.model.transformer import (DecodeState, KVCache, Transformer, abstract_params,
                                     init_state)

__all__ = [
    "ModelConfig",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "DecodeState",
    "KVCache",
    "KV_BITS",
    "kv_stored",
    "kv_values",
    "LinearState",
    "RoutedExperts",
    "Transformer",
    "abstract_params",
    "init_state",
]
