"""Model configuration: one small frozen dataclass read from a Hugging Face ``config.json``.

Families differ only by named options (``qk_norm``, ``router``, ``qkv_bias``, ...); layers
read those options and never branch on ``model_type``. Both key styles found in the wild
are accepted: hub checkpoints (``num_experts``, ``rope_theta``, ``rope_scaling``,
``torch_dtype``) and files written by current transformers (``num_local_experts``,
``rope_parameters``, ``dtype``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any, Literal

import numpy as np

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_next",
                         "qwen3_5_moe", "gpt_oss", "minimax_m2", "glm4_moe", "deepseek_v3",
                         "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")
# DeepSeek Sparse Attention families (DeepSeek-V3.2, GLM-5): latent attention whose queries each
# attend to the index_topk earlier tokens a lightning indexer picks. Up to index_topk tokens of
# context that is every earlier token: dense latent attention, which is what ftjax runs (the
# indexer is not read), so their context is limited to index_topk (``sparse_attention_topk``).
DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# Checkpoints of another model_type that are the same architecture as a supported one (Kimi-K2
# ships DeepSeek-V3's).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
# Hybrid families: Gated DeltaNet ("linear_attention") layers between gated full-attention
# layers. ``qwen3_5_moe_text`` is the text-only config of ``qwen3_5_moe``.
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
# Families whose MTP layers are stored as decoder layers past num_hidden_layers (DeepSeek's
# layout: ``model.layers.{L + j}.enorm / hnorm / eh_proj / shared_head`` and a MoE layer),
# named by ``num_nextn_predict_layers``.
DEEPSEEK_MTP_MODEL_TYPES = ("glm4_moe", "deepseek_v3", "glm4_moe_lite", "deepseek_v32",
                            "glm_moe_dsa")
MTP_MODEL_TYPES = HYBRID_MODEL_TYPES + DEEPSEEK_MTP_MODEL_TYPES

# Mixer kinds a layer can have: softmax attention (full or sliding window) carries a KV
# cache, linear attention (Gated DeltaNet) a conv state and a recurrent state.
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")

RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid_group"]
QKNorm = Literal["per_head", "full"] | None
# The routed experts' function between their projections (``ftjax.experts``):
# ``swiglu``: silu(g) * u; ``clamped_swiglu`` (gpt-oss): g = min(g, limit),
# u = clip(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g).
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")


class UnsupportedModelError(ValueError):
  """The checkpoint's architecture or one of its options is not supported."""


@dataclasses.dataclass(frozen=True)
class Yarn:
  """YaRN rotary scaling (transformers' ``_compute_yarn_parameters``): each rotary frequency
  blends the original one (fast dims, extrapolated) with it divided by ``factor`` (slow dims,
  interpolated), by a linear ramp over the dims between the correction dims of ``beta_fast``
  and ``beta_slow`` rotations in ``original_max_position`` tokens (rounded outwards when
  ``truncate``); cos and sin are scaled by ``attention_factor``."""

  factor: float
  beta_fast: float
  beta_slow: float
  original_max_position: int
  truncate: bool
  attention_factor: float

  def inv_freq(self, theta: float, width: int) -> np.ndarray:
    """The [width / 2] inverse frequencies (float32, as transformers computes them)."""
    def correction_dim(rotations):
      return (width * math.log(self.original_max_position / (rotations * 2 * math.pi))
              / (2 * math.log(theta)))
    low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, width - 1)
    if low == high:
      high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(width // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = (theta ** (np.arange(0, width, 2, dtype=np.float32) / width)).astype(np.float32)
    return ((1.0 / (self.factor * pos_freqs)) * (1 - extrapolation)
            + (1.0 / pos_freqs) * extrapolation).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and options of one MoE decoder. All MoE layers share one expert shape."""

  model_type: str
  vocab_size: int
  hidden_size: int  # D
  num_layers: int  # L
  num_heads: int  # H
  num_kv_heads: int  # G
  head_dim: int  # A
  num_experts: int  # E
  top_k: int  # K
  moe_intermediate_size: int  # F
  rms_norm_eps: float
  rope_theta: float
  max_position_embeddings: int
  layer_types: tuple[str, ...]
  sliding_window: int | None = None
  qk_norm: QKNorm = None
  qkv_bias: bool = False
  o_bias: bool = False
  clip_qkv: float | None = None
  router: RouterKind = "softmax_topk"
  norm_topk_prob: bool = False
  router_groups: int = 1  # sigmoid_group: experts are split into this many groups
  router_topk_groups: int = 1  # sigmoid_group: experts are chosen within this many groups
  routed_scaling_factor: float = 1.0  # sigmoid_group: scales the routed weights
  attn_sinks: bool = False  # a learned per-head logit joins each softmax (gpt-oss)
  router_bias: bool = False  # the router is a linear layer with a bias (gpt-oss)
  # The routed experts (gpt-oss: clamped SwiGLU, biases on gate, up and down).
  expert_activation: str = "swiglu"  # one of EXPERT_ACTIVATIONS
  swiglu_alpha: float = 1.702  # clamped_swiglu: the sigmoid's gain
  swiglu_limit: float = 7.0  # clamped_swiglu: the clamp of gate (above) and up (both sides)
  expert_bias: bool = False  # gate, up and down biases, stored in the expert block
  yarn: Yarn | None = None  # YaRN rotary scaling; None = plain RoPE
  shared_expert_intermediate_size: int = 0  # I; 0 = no shared expert
  shared_expert_gate: bool = False  # sigmoid(x · w) scales the shared expert
  partial_rotary_factor: float = 1.0  # rotary on the first head_dim · factor dims of q and k
  attn_output_gate: bool = False  # q_proj also yields a per-head sigmoid gate on the output
  norm_zero_centred: bool = False  # RMSNorm scales by (1 + w), w initialised to 0
  # Gated DeltaNet ("linear_attention" layers): key heads Hk of Dk, value heads Hv of Dv,
  # and the width of the causal depthwise conv over q, k and v.
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel: int = 0
  tie_word_embeddings: bool = False
  source_dtype: str = "float32"
  eos_token_ids: tuple[int, ...] = ()
  # Image/video placeholder ids of a vision-language checkpoint: ftjax runs its text model
  # only, so a prompt holding one of these is refused.
  vision_token_ids: tuple[int, ...] = ()
  # Multi-token-prediction (MTP) layers of Qwen3-Next / Qwen3.5-MoE (``mtp.*``) and of GLM /
  # DeepSeek (decoder layers past num_hidden_layers; ``ftjax.model.transformer.MTPHead``):
  # each a full-attention MoE decoder layer after a projection of the next token's embedding
  # and the model's hidden state. Their routed experts sit in the expert bank after the
  # decoder's MoE layers (``bank_layer``). 0: none.
  mtp_layers: int = 0
  # Decoder layers whose feed-forward is a dense SwiGLU MLP of ``dense_intermediate_size``
  # instead of a MoE (GLM's and DeepSeek's ``first_k_dense_replace`` first layers, Qwen-MoE's
  # ``mlp_only_layers`` / ``decoder_sparse_step``). The expert bank holds the MoE layers only,
  # in order (``bank_layer``), then the MTP layers.
  dense_layers: tuple[int, ...] = ()
  dense_intermediate_size: int = 0
  # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) when ``kv_lora_rank`` > 0
  # (``ftjax.model.layers.LatentAttention``): queries through a rank ``q_lora_rank`` bottleneck
  # (0: one projection), keys and values from a normed latent of ``kv_lora_rank`` per token plus
  # one shared rotary key of ``head_dim`` (qk_rope_head_dim) dims, which the KV cache holds
  # instead of per-head keys and values; per head ``qk_nope_head_dim`` unrotated query/key dims
  # and ``v_head_dim`` value dims. ``rope_interleave``: the rotary dims pair (0, 1), (2, 3), ..
  # (DeepSeek's layout) instead of (i, i + A/2). ``softmax_scale_factor`` multiplies the
  # scores' 1/sqrt(qk head dims) (YaRN's mscale_all_dim, squared).
  kv_lora_rank: int = 0
  q_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  v_head_dim: int = 0
  rope_interleave: bool = False
  softmax_scale_factor: float = 1.0
  # DeepSeek Sparse Attention's index_topk (DSA_MODEL_TYPES; 0: none): the longest context that
  # dense attention serves exactly; the engine refuses a longer one.
  sparse_attention_topk: int = 0

  def __post_init__(self):
    if len(self.layer_types) != self.num_layers:
      raise UnsupportedModelError(
          f"layer_types has {len(self.layer_types)} entries but num_layers is {self.num_layers}")
    for kind in self.layer_types:
      if kind not in LAYER_TYPES:
        raise UnsupportedModelError(
            f"unknown layer type {kind!r}; supported layer types: {', '.join(LAYER_TYPES)}")
    if "sliding_attention" in self.layer_types and not self.sliding_window:
      raise UnsupportedModelError("a sliding_attention layer needs sliding_window > 0")
    if self.mtp_layers < 0 or (self.mtp_layers and self.model_type not in MTP_MODEL_TYPES):
      raise UnsupportedModelError(
          f"mtp_layers={self.mtp_layers}: multi-token-prediction layers are read for "
          f"{', '.join(MTP_MODEL_TYPES)} checkpoints only")
    dense = self.dense_layers
    if dense:
      if list(dense) != sorted(set(dense)) or not 0 <= dense[0] <= dense[-1] < self.num_layers:
        raise UnsupportedModelError(
            f"dense_layers={list(dense)} must be distinct decoder layers in [0, "
            f"{self.num_layers}), in order")
      if len(dense) == self.num_layers:
        raise UnsupportedModelError(
            "every decoder layer is a dense MLP layer: ftjax serves mixture-of-experts models, "
            "and this config has no MoE layer")
      if self.dense_intermediate_size <= 0:
        raise UnsupportedModelError(
            f"dense MLP layers {list(dense)} need dense_intermediate_size > 0 (config.json: "
            "intermediate_size)")
    if self.kv_lora_rank and min(self.qk_nope_head_dim, self.v_head_dim) <= 0:
      raise UnsupportedModelError(
          f"latent attention (kv_lora_rank={self.kv_lora_rank}) needs positive qk_nope_head_dim "
          f"and v_head_dim, got {self.qk_nope_head_dim} and {self.v_head_dim}")
    if self.sparse_attention_topk < 0 or (self.sparse_attention_topk and not self.kv_lora_rank):
      raise UnsupportedModelError("sparse_attention_topk needs latent attention (kv_lora_rank)")
    if self.kv_lora_rank and ("sliding_attention" in self.layer_types or self.attn_sinks):
      raise UnsupportedModelError("latent attention with a sliding window or sinks is not "
                                  "supported")
    if self.num_heads % self.num_kv_heads:
      raise UnsupportedModelError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if not 0 < self.top_k <= self.num_experts:
      raise UnsupportedModelError(
          f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
    if self.router not in ("softmax_topk", "topk_softmax", "sigmoid_group"):
      raise UnsupportedModelError(
          f"unknown router {self.router!r}; supported: softmax_topk, topk_softmax, sigmoid_group")
    if self.router == "sigmoid_group":
      g, kg = self.router_groups, self.router_topk_groups
      if g < 1 or self.num_experts % g or self.num_experts // g < 2 or not 1 <= kg <= g:
        raise UnsupportedModelError(
            f"sigmoid_group routing needs num_experts ({self.num_experts}) split into "
            f"router_groups ({g}) groups of at least 2 and 1 <= router_topk_groups ({kg}) <= "
            "router_groups")
    if self.expert_activation not in EXPERT_ACTIVATIONS:
      raise UnsupportedModelError(
          f"unknown expert_activation {self.expert_activation!r}; supported: "
          f"{', '.join(EXPERT_ACTIVATIONS)}")
    if self.qk_norm not in (None, "per_head", "full"):
      raise UnsupportedModelError(f"qk_norm must be None, 'per_head' or 'full', got {self.qk_norm!r}")
    rotary = self.rotary_dim
    if not (0 < rotary <= self.head_dim and rotary % 2 == 0):
      raise UnsupportedModelError(
          f"partial_rotary_factor={self.partial_rotary_factor} gives {rotary} rotary dims of "
          f"head_dim={self.head_dim}; it must be an even number in [2, head_dim]")
    if "linear_attention" in self.layer_types:
      dims = {k: getattr(self, k) for k in (
          "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
          "linear_value_head_dim", "linear_conv_kernel")}
      bad = [k for k, v in dims.items() if v <= 0]
      if bad:
        raise UnsupportedModelError(
            f"linear_attention layers need positive {', '.join(bad)} (config.json: "
            "linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, "
            "linear_value_head_dim, linear_conv_kernel_dim)")
      if self.linear_num_value_heads % self.linear_num_key_heads:
        raise UnsupportedModelError(
            f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads={self.linear_num_key_heads}")

  # -- Derived shapes -----------------------------------------------------------------------

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """The decoder layers that are MoE layers (all but ``dense_layers``), in order."""
    dense = set(self.dense_layers)
    return tuple(i for i in range(self.num_layers) if i not in dense)

  @property
  def num_decoder_moe_layers(self) -> int:
    """The decoder's MoE layers: bank layers 0 .. this - 1 (the MTP layers' come after)."""
    return self.num_layers - len(self.dense_layers)

  @property
  def num_moe_layers(self) -> int:
    """MoE layers whose routed experts are in the bank: the decoder's MoE layers, then the
    MTP layers."""
    return self.num_decoder_moe_layers + self.mtp_layers

  def bank_layer(self, layer: int) -> int | None:
    """The expert-bank layer of decoder layer ``layer`` (None for a dense MLP layer); layers
    ``num_layers ..`` are the MTP layers, whose bank layers follow the decoder's."""
    if layer >= self.num_layers:
      return self.num_decoder_moe_layers + layer - self.num_layers
    if layer in self.dense_layers:
      return None
    return layer - sum(d < layer for d in self.dense_layers)

  @property
  def rotary_dim(self) -> int:
    """Dimensions of each q/k head that RoPE rotates (the first ones; the rest pass)."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def latent_attention(self) -> bool:
    return self.kv_lora_rank > 0

  @property
  def kv_cache_shape(self) -> tuple[int, int, int]:
    """``(heads, key width, value width)`` of one token's KV cache rows in an attention layer:
    (G, A, A) for grouped-query attention; (1, kv_lora_rank + head_dim, 0) for latent
    attention (the normed latent and the rotated shared key, read as both key and value)."""
    if self.latent_attention:
      return 1, self.kv_lora_rank + self.head_dim, 0
    return self.num_kv_heads, self.head_dim, self.head_dim

  @property
  def kv_elements_per_token(self) -> int:
    """KV cache elements one token takes in one attention layer."""
    g, k, v = self.kv_cache_shape
    return g * (k + v)

  @property
  def linear_key_dim(self) -> int:
    return self.linear_num_key_heads * self.linear_key_head_dim

  @property
  def linear_value_dim(self) -> int:
    return self.linear_num_value_heads * self.linear_value_head_dim

  @property
  def linear_conv_dim(self) -> int:
    """Channels of the causal conv: q, k (key_dim each) and v (value_dim)."""
    return 2 * self.linear_key_dim + self.linear_value_dim

  @property
  def expert_block_elems(self) -> int:
    """Elements of one expert: gate [F, D], up [F, D], down [D, F], then with
    ``expert_bias`` the biases of gate [F], up [F] and down [D]."""
    f, d = self.moe_intermediate_size, self.hidden_size
    return 3 * f * d + ((2 * f + d) if self.expert_bias else 0)

  # -- Serialisation ------------------------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise UnsupportedModelError(
          f"unknown model config fields {unknown}; this file was written by a newer ftjax")
    d = dict(d)
    for key in ("layer_types", "eos_token_ids", "vision_token_ids", "dense_layers"):
      if key in d:
        d[key] = tuple(d[key])
    if d.get("yarn") is not None:
      d["yarn"] = Yarn(**d["yarn"])
    return cls(**d)

  @classmethod
  def from_hf_config(cls, hf: dict[str, Any]) -> "ModelConfig":
    return from_hf_config(hf)

  @classmethod
  def from_hf_dir(cls, path: str | os.PathLike) -> "ModelConfig":
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
      raise FileNotFoundError(
          f"{config_path} not found: --model must be an ftjax (FTW) directory or a Hugging Face "
          "checkpoint directory containing config.json")
    with open(config_path) as f:
      return from_hf_config(json.load(f))


# Per-family defaults where hub configs may omit a key; the values are those of the
# transformers configuration classes.
_DEFAULT_ROPE_THETA = {"qwen3_moe": 10000.0, "qwen2_moe": 10000.0, "mixtral": 1e6, "olmoe": 10000.0,
                       "qwen3_next": 10000.0, "qwen3_5_moe": 10000.0, "gpt_oss": 150000.0,
                       "minimax_m2": 5e6, "glm4_moe": 10000.0, "deepseek_v3": 10000.0,
                       "glm4_moe_lite": 10000.0, "deepseek_v32": 10000.0, "glm_moe_dsa": 10000.0}
_DEFAULT_EPS = {"qwen3_moe": 1e-6, "qwen2_moe": 1e-6, "mixtral": 1e-5, "olmoe": 1e-5,
                "qwen3_next": 1e-6, "qwen3_5_moe": 1e-6, "gpt_oss": 1e-5, "minimax_m2": 1e-6,
                "glm4_moe": 1e-5, "deepseek_v3": 1e-6, "glm4_moe_lite": 1e-5, "deepseek_v32": 1e-6,
                "glm_moe_dsa": 1e-5}


# Families with dense first layers (``first_k_dense_replace``, transformers' default), and
# those whose dense layers come from ``mlp_only_layers`` / ``decoder_sparse_step``.
_FIRST_K_DENSE = {"glm4_moe": 1, "deepseek_v3": 3, "glm4_moe_lite": 1, "deepseek_v32": 3,
                  "glm_moe_dsa": 3}
_SPARSE_STEP = ("qwen3_moe", "qwen2_moe", "qwen3_next")

# gpt-oss's rope when config.json names none (transformers' GptOssConfig default).
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


# transformers' partial_rotary_factor where config.json names none.
_DEFAULT_PARTIAL_ROTARY = {"qwen3_next": 0.25, "qwen3_5_moe": 0.25, "glm4_moe": 0.5}


def _notice(message: str) -> None:
  print(f"ftjax: {message}", file=sys.stderr)


def _rope(hf: dict[str, Any], model_type: str) -> tuple[float, float, Yarn | None]:
  """(theta, partial_rotary_factor, YaRN scaling or None) from ``rope_parameters`` (new) or
  ``rope_theta`` / ``rope_scaling`` (hub)."""
  params = hf.get("rope_parameters")
  if params:
    # Per-layer-type nesting ({"full_attention": {...}}) appears in some new configs.
    if "rope_theta" not in params and "rope_type" not in params and len(params) > 0:
      inner = list(params.values())
      if all(isinstance(v, dict) for v in inner) and all(v == inner[0] for v in inner):
        params = inner[0]
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA[model_type]))
  else:
    params = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = hf.get("rope_theta", _DEFAULT_ROPE_THETA[model_type])
  if rope_type not in ("default", "yarn"):
    raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported yet (supported: 'default', 'yarn'); "
        "remove rope scaling from config.json only if you stay within the original context")
  yarn = _yarn(hf, params) if rope_type == "yarn" else None
  default_partial = _DEFAULT_PARTIAL_ROTARY.get(model_type, 1.0)
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
  if partial is None and hf.get("rotary_dim"):  # MiniMax's legacy key: the rotary dims
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    partial = int(hf["rotary_dim"]) / head_dim
  partial = float(default_partial if partial is None else partial)
  section = params.get("mrope_section")
  if section is not None:
    # Multimodal RoPE gives each of 3 position grids (time, height, width) a section of the
    # rotary frequencies. Text tokens have the same position on every grid, so it equals 1-D
    # RoPE whatever the sections, provided they partition the rotary frequencies.
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    half = int(head_dim * partial) // 2
    if len(section) != 3 or sum(int(s) for s in section) != half:
      raise UnsupportedModelError(
          f"rope_parameters.mrope_section={list(section)} does not split the {half} rotary "
          "frequencies into 3 sections, so it is not the text-only multimodal RoPE that ftjax "
          "runs as 1-D RoPE; fix the sections in config.json")
  return float(theta), partial, yarn


def _yarn(hf: dict[str, Any], params: dict[str, Any]) -> Yarn:
  """YaRN's parameters with transformers' defaults (``_compute_yarn_parameters`` and
  ``standardize_rope_params``): a top-level ``original_max_position_embeddings`` wins over
  the rope dict's, which defaults to ``max_position_embeddings``; a missing ``factor`` is
  their ratio; ``truncate`` defaults to true; the attention factor, unless given, is
  ``0.1 · ln(factor) + 1`` (or the ratio of two such terms with ``mscale`` and
  ``mscale_all_dim``)."""
  max_pos = int(hf.get("max_position_embeddings", 4096))
  original = hf.get("original_max_position_embeddings") or params.get(
      "original_max_position_embeddings") or max_pos
  factor = params.get("factor")
  factor = float(factor) if factor is not None else max_pos / float(original)

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attention = params.get("attention_factor")
  if attention is None:
    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
  return Yarn(factor=factor, beta_fast=float(params.get("beta_fast") or 32),
              beta_slow=float(params.get("beta_slow") or 1),
              original_max_position=int(original), truncate=bool(params.get("truncate", True)),
              attention_factor=float(attention))


def _eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
  eos = hf.get("eos_token_id")
  if eos is None:
    return ()
  return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


class _Required(dict):
  """config.json as a dict whose missing keys are a clear error, not a bare KeyError."""

  def __missing__(self, key):
    raise UnsupportedModelError(
        f"config.json of this {self.get('model_type')} checkpoint lacks the required key {key!r}")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
  """The text model's config of a checkpoint: ``text_config`` of a composite (vision +
  language) config such as Qwen3.5/3.6's, else the config itself. Composite configs keep
  some keys (dtype, tie_word_embeddings, eos_token_id) at the top level only."""
  text = hf.get("text_config")
  if not text:
    return dict(hf)
  merged = {k: hf[k] for k in ("dtype", "torch_dtype", "tie_word_embeddings", "eos_token_id")
            if k in hf}
  merged.update(text)
  merged["model_type"] = hf.get("model_type")
  return merged


def _hybrid_options(hf: dict[str, Any], num_layers: int) -> tuple[list[str], dict[str, Any]]:
  """Layer types and options of a Qwen3-Next / Qwen3.5-MoE config."""
  layer_types = hf.get("layer_types")
  if not layer_types:
    interval = int(hf.get("full_attention_interval", 4))
    layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                   for i in range(num_layers)]
  if hf.get("attention_bias", False):
    raise UnsupportedModelError("attention_bias=true is not supported for hybrid models")
  if not hf.get("attn_output_gate", True):
    raise UnsupportedModelError(
        "attn_output_gate=false is not supported: transformers' Qwen3-Next / Qwen3.5 attention "
        "always gates its output")
  # Qwen3.5 names its MTP layers in config.json; Qwen3-Next's config does not, and the
  # converter counts them in the checkpoint (``ftjax.formats.hf``).
  mtp = int(hf.get("mtp_num_hidden_layers") or hf.get("num_nextn_predict_layers") or 0)
  options = dict(
      mtp_layers=mtp,
      qk_norm="per_head", norm_zero_centred=True, attn_output_gate=True,
      shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]),
      shared_expert_gate=True,
      linear_num_key_heads=int(hf["linear_num_key_heads"]),
      linear_num_value_heads=int(hf["linear_num_value_heads"]),
      linear_key_head_dim=int(hf["linear_key_head_dim"]),
      linear_value_head_dim=int(hf["linear_value_head_dim"]),
      linear_conv_kernel=int(hf["linear_conv_kernel_dim"]))
  return list(layer_types), options


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
  """Builds a ModelConfig from a Hugging Face config dict of a supported MoE family."""
  model_type = hf.get("model_type")
  vision_ids = tuple(int(hf[k]) for k in ("image_token_id", "video_token_id",
                                          "vision_start_token_id", "vision_end_token_id")
                     if hf.get(k) is not None)
  if hf.get("text_config"):
    if hf.get("vision_config"):
      _notice(f"{model_type}: the vision tower is skipped (ftjax runs the text model; image and "
              "video inputs are not supported)")
    hf = text_config(hf)
  if model_type == "qwen3_5_moe_text":
    model_type = "qwen3_5_moe"
  model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
  hf = _Required(hf)
  layer_types = hf.get("layer_types") or []
  if "linear_attention" in layer_types and model_type not in HYBRID_MODEL_TYPES:
    raise UnsupportedModelError(
        f"{model_type} has 'linear_attention' layers (Gated DeltaNet), which ftjax implements "
        f"only for the hybrid families {', '.join(HYBRID_MODEL_TYPES)}; check model_type in "
        "config.json")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise UnsupportedModelError(
        f"unsupported model_type {model_type!r}; ftjax supports: {', '.join(SUPPORTED_MODEL_TYPES)}")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu / SwiGLU experts)")
  num_layers = int(hf["num_hidden_layers"])
  num_heads = int(hf["num_attention_heads"])
  hidden = int(hf["hidden_size"])
  num_experts = hf.get("num_experts", hf.get("num_local_experts", hf.get("n_routed_experts")))
  if num_experts is None:
    raise UnsupportedModelError(
        "config.json has none of num_experts, num_local_experts and n_routed_experts")
  dense_layers = _dense_layers(hf, model_type, num_layers)

  # Families: shared fields first, then the named options that tell them apart.
  options: dict[str, Any] = {}
  sliding_window = None
  layer_types = ["full_attention"] * num_layers
  if model_type == "qwen3_moe":
    bias = bool(hf.get("attention_bias", False))
    options.update(qk_norm="per_head", qkv_bias=bias, o_bias=bias,
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    ffn = hf["moe_intermediate_size"]
    if hf.get("use_sliding_window", False):
      sliding_window = hf.get("sliding_window")
      layer_types = ["sliding_attention"] * num_layers
  elif model_type in ("qwen3_next", "qwen3_5_moe"):
    layer_types, hybrid = _hybrid_options(hf, num_layers)
    options.update(hybrid)
    # Qwen3-Next's router renormalises the top-k weights when norm_topk_prob (default true);
    # Qwen3.5's always does.
    options["norm_topk_prob"] = (bool(hf.get("norm_topk_prob", True))
                                 if model_type == "qwen3_next" else True)
    ffn = hf["moe_intermediate_size"]
  elif model_type == "qwen2_moe":
    shared = int(hf.get("shared_expert_intermediate_size", 0) or 0)
    options.update(qkv_bias=bool(hf.get("qkv_bias", True)),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0)
    ffn = hf["moe_intermediate_size"]
    if hf.get("layer_types"):
      layer_types = list(hf["layer_types"])
      sliding_window = hf.get("sliding_window")
    elif hf.get("use_sliding_window", False):
      raise UnsupportedModelError(
          "qwen2_moe with use_sliding_window=true but no layer_types: transformers versions disagree "
          "on which layers slide; add an explicit layer_types list to config.json")
  elif model_type == "mixtral":
    options.update(norm_topk_prob=True)  # Mixtral always renormalises the top-k weights
    ffn = hf["intermediate_size"]
    if hf.get("sliding_window"):
      sliding_window = hf["sliding_window"]
      layer_types = ["sliding_attention"] * num_layers
  elif model_type == "gpt_oss":
    bias = bool(hf.get("attention_bias", True))
    options.update(qkv_bias=bias, o_bias=bias, attn_sinks=True, router="topk_softmax",
                   router_bias=True, expert_activation="clamped_swiglu", expert_bias=True,
                   swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                   swiglu_limit=float(hf.get("swiglu_limit", 7.0)))
    ffn = hf["intermediate_size"]
    # transformers' default: even layers slide, odd layers attend to everything.
    layer_types = list(hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)])
    sliding_window = hf.get("sliding_window", 128)
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
      hf["rope_scaling"] = dict(_GPT_OSS_ROPE)  # transformers' GptOssConfig default
  elif model_type == "minimax_m2":
    # transformers' MiniMaxM2: q_norm / k_norm over all heads' dims at once, sigmoid scores
    # chosen on score + e_score_correction_bias, the chosen scores renormalised, no scaling.
    scoring = hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
      raise UnsupportedModelError(f"minimax_m2 with scoring_func={scoring!r}: only 'sigmoid' "
                                  "routing (MiniMax-M2's) is supported")
    options.update(qk_norm="full", router="sigmoid_group", norm_topk_prob=True)
    ffn = hf["intermediate_size"]
  elif model_type == "glm4_moe":
    # GLM-4.5 / 4.6 / 4.7: DeepSeek-V3's routing (sigmoid scores chosen on score + bias within
    # the best groups, renormalised, scaled), ungated shared experts, dense first layers.
    options.update(qk_norm="per_head" if hf.get("use_qk_norm", False) else None,
                   qkv_bias=bool(hf.get("attention_bias", False)), router="sigmoid_group",
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                   router_groups=int(hf.get("n_group", 1) or 1),
                   router_topk_groups=int(hf.get("topk_group", 1) or 1),
                   routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                   shared_expert_intermediate_size=int(hf["moe_intermediate_size"])
                   * int(hf.get("n_shared_experts", 1) or 0))
    ffn = hf["moe_intermediate_size"]
  elif model_type in ("deepseek_v3", "glm4_moe_lite") + DSA_MODEL_TYPES:
    # GLM-4.7-Flash is DeepSeek-V3's design; DeepSeek-V3.2 and GLM-5 add sparse attention
    if hf.get("attention_bias", False):
      raise UnsupportedModelError(f"{model_type} with attention_bias=true is not supported")
    nope, rope_dim = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    options.update(
        router="sigmoid_group", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        router_groups=int(hf.get("n_group", 1) or 1),
        router_topk_groups=int(hf.get("topk_group", 1) or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        shared_expert_intermediate_size=int(hf["moe_intermediate_size"])
        * int(hf.get("n_shared_experts", 1) or 0),
        kv_lora_rank=int(hf["kv_lora_rank"]), q_lora_rank=int(hf.get("q_lora_rank") or 0),
        qk_nope_head_dim=nope, v_head_dim=int(hf["v_head_dim"]),
        # (DeepSeek-V3.2's and GLM-5's attention always pairs its rotary dims (2i, 2i + 1))
        rope_interleave=bool(hf.get("rope_interleave", True)) or model_type in DSA_MODEL_TYPES)
    hf["head_dim"] = rope_dim  # the rotary key's dims, as transformers sets it
    if model_type in DSA_MODEL_TYPES:
      options["sparse_attention_topk"] = int(hf.get("index_topk", 2048))
    ffn = hf["moe_intermediate_size"]
  else:  # olmoe
    bias = bool(hf.get("attention_bias", False))
    options.update(qk_norm="full", qkv_bias=bias, o_bias=bias, clip_qkv=hf.get("clip_qkv"),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    ffn = hf["intermediate_size"]

  if model_type in DEEPSEEK_MTP_MODEL_TYPES:  # the converter counts what the checkpoint has
    options["mtp_layers"] = int(hf.get("num_nextn_predict_layers",
                                       hf.get("num_mtp_layers")) or 0)
  theta, partial, yarn = _rope(hf, model_type)
  if options.get("kv_lora_rank"):
    options["softmax_scale_factor"] = _mla_softmax_factor(hf)
  return ModelConfig(
      model_type=model_type,
      vocab_size=int(hf["vocab_size"]),
      hidden_size=hidden,
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
      head_dim=int(hf.get("head_dim") or hidden // num_heads),
      num_experts=int(num_experts),
      top_k=int(hf["num_experts_per_tok"]),
      moe_intermediate_size=int(ffn),
      rms_norm_eps=float(hf.get("rms_norm_eps", _DEFAULT_EPS[model_type])),
      rope_theta=theta,
      partial_rotary_factor=partial,
      yarn=yarn,
      max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
      layer_types=tuple(layer_types),
      sliding_window=int(sliding_window) if sliding_window else None,
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      source_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
      eos_token_ids=_eos_ids(hf),
      vision_token_ids=vision_ids,
      dense_layers=tuple(dense_layers),
      dense_intermediate_size=int(hf["intermediate_size"]) if dense_layers else 0,
      **options,
  )


def _mla_softmax_factor(hf: dict[str, Any]) -> float:
  """DeepSeek's scores scale by (0.1 · mscale_all_dim · ln(factor) + 1)^2 more under YaRN
  (transformers' ``yarn_apply_mscale``), the non-rotary dims as well."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if params.get("rope_type", params.get("type", "default")) == "default":
    return 1.0
  m_all, factor = params.get("mscale_all_dim", 0), float(params.get("factor") or 1.0)
  if not m_all or factor <= 1:
    return 1.0
  return (0.1 * float(m_all) * math.log(factor) + 1.0) ** 2


def _dense_layers(hf: dict[str, Any], model_type: str, num_layers: int) -> list[int]:
  """The decoder layers whose feed-forward is a dense MLP, as each family's transformers model
  decides: the first ``first_k_dense_replace`` (GLM, DeepSeek); those in ``mlp_only_layers``
  or off the ``decoder_sparse_step`` (Qwen-MoE: layer i is MoE when (i + 1) % step == 0)."""
  if hf.get("mlp_layer_types"):  # GLM-4.7-Flash: "dense" or "sparse" per layer
    kinds = list(hf["mlp_layer_types"])
    if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
      raise UnsupportedModelError(
          f"mlp_layer_types must name 'dense' or 'sparse' for each of the {num_layers} layers, "
          f"got {kinds}")
    return [i for i, kind in enumerate(kinds) if kind == "dense"]
  if model_type in _FIRST_K_DENSE:
    return list(range(min(int(hf.get("first_k_dense_replace", _FIRST_K_DENSE[model_type]) or 0),
                          num_layers)))
  mlp_only = [int(i) for i in hf.get("mlp_only_layers") or []]
  step = int(hf.get("decoder_sparse_step", 1) or 1)
  if not (mlp_only or step != 1):
    return []
  if model_type not in _SPARSE_STEP:
    raise UnsupportedModelError(
        f"{model_type} with mlp_only_layers / decoder_sparse_step: dense MLP layers between MoE "
        f"layers are read for {', '.join(_SPARSE_STEP)} (as transformers places them)")
  return [i for i in range(num_layers) if i in mlp_only or (i + 1) % step]
