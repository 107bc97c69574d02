"""Hugging Face safetensors checkpoint -> FTW, streamed tensor by tensor.

Accepts one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``, and
both expert layouts found in the wild: per-expert keys (``mlp.experts.{e}.gate_proj.weight``,
Mixtral's ``block_sparse_moe.experts.{e}.w1/w2/w3``) and fused 3-D tensors
(``mlp.experts.gate_up_proj`` [E, 2F, D] with gate rows first, ``mlp.experts.down_proj``
[E, D, F]). Peak memory is about one dense tensor in the output dtype plus one mapped source
tensor, not the checkpoint (measured by benchmarks/convert_memory.py).

Hybrid families: composite (vision + language) checkpoints keep the text model under
``model.language_model.``; the vision tower (``model.visual.``) is skipped. Their
multi-token-prediction (MTP) head is kept (``ftjax.model.transformer.MTPHead``): ``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden`` and ``mtp.norm`` become ``mtp.w_fc_dx``,
``mtp.embed_norm``, ``mtp.hidden_norm`` and ``mtp.final_norm``; ``mtp.layers.{j}.*`` are decoder
layers named as the model's own, whose routed experts go to bank layer ``num_layers + j``.
Qwen3-Next's config.json does not name its MTP layers: they are counted in the checkpoint. A
checkpoint whose config names MTP layers but which ships no ``mtp.`` tensors (some re-uploads
drop them) converts without them. Gated DeltaNet projections come split (Qwen3.5:
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) or fused per key-head group
(Qwen3-Next: ``in_proj_qkvz``, ``in_proj_ba``), which is split here into the same
parameters. A gated attention's ``q_proj`` holds, per head, the query then its output gate.

gpt-oss stores its fused experts the other way round, ``[in, out]``: ``gate_up_proj``
[E, D, 2F] with gate and up interleaved (columns 2f and 2f + 1), ``down_proj`` [E, F, D], and
their biases ``gate_up_proj_bias`` [E, 2F] (interleaved too) and ``down_proj_bias`` [E, D];
they become each block's gate, up, down and bias parts. gpt-oss ships those experts in MXFP4
(``quantization_config.quant_method == "mxfp4"``): ``gate_up_proj_blocks`` [E, 2F, D/32, 16]
and ``gate_up_proj_scales`` [E, 2F, D/32] (rows are outputs, [out, in] like ftjax's blocks; gate
and up interleaved by row: gate = rows 2f, up = rows 2f + 1), ``down_proj_blocks``
[E, D, F/32, 16] and ``down_proj_scales`` [E, D, F/32]. They are kept as they are (codes and
E8M0 scales, never expanded to floats) in an FTW ``mxfp4`` bank (``ftjax.utils.quant``).

Block-scaled FP8 checkpoints (``quant_method == "fp8"``: Qwen, DeepSeek, MiniMax, Kimi) are read
through ``ftjax.formats.fp8``: each e4m3 weight is dequantised to float32 with its
``weight_scale_inv`` block scales as it is read, then stored like any float weight.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ftjax.formats import fp8, ftw
from ftjax.formats.safetensors import SafetensorsFile
from ftjax.model.config import DEEPSEEK_MTP_MODEL_TYPES, ModelConfig
from ftjax.model.transformer import abstract_params
from ftjax.utils import paths
from ftjax.utils.progress import Progress

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
                   "chat_template.jinja")


class ConversionError(ValueError):
  pass


def _shard_paths(hf_dir: str) -> list[str]:
  index = os.path.join(hf_dir, "model.safetensors.index.json")
  single = os.path.join(hf_dir, "model.safetensors")
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
    paths = [os.path.join(hf_dir, name) for name in files]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
      raise ConversionError(f"shards listed in {index} are missing: {', '.join(missing)}")
    return paths
  if os.path.isfile(single):
    return [single]
  found = sorted(p for p in os.listdir(hf_dir) if p.endswith(".safetensors"))
  if found:
    return [os.path.join(hf_dir, p) for p in found]
  raise ConversionError(
      f"no safetensors weights in {hf_dir} (expected model.safetensors or "
      "model.safetensors.index.json); .bin / .pth checkpoints are not supported: re-save them "
      "with save_pretrained(safe_serialization=True)")


def fingerprint(hf_dir: str | os.PathLike) -> str:
  """Identifies a checkpoint cheaply: config.json plus every shard's name, size and header."""
  hf_dir = os.fspath(hf_dir)
  h = hashlib.sha256()
  with open(os.path.join(hf_dir, "config.json"), "rb") as f:
    h.update(f.read())
  for path in _shard_paths(hf_dir):
    st = SafetensorsFile(path)
    h.update(os.path.basename(path).encode())
    h.update(str(os.path.getsize(path)).encode())
    h.update(st.header_bytes)
  return "sha256:" + h.hexdigest()


# Dense tensors: HF name (after the leading "model.") -> (ftjax parameter path, reshape).
_LAYER = r"layers\.(\d+)\."
_DENSE_RULES: list[tuple[str, str]] = [
    (r"embed_tokens\.weight", "embed_vd"),
    (r"norm\.weight", "final_norm.scale"),
    (r"lm_head\.weight", "w_lm_vd"),
    (_LAYER + r"input_layernorm\.weight", "layers.{0}.attn_norm.scale"),
    (_LAYER + r"post_attention_layernorm\.weight", "layers.{0}.mlp_norm.scale"),
    (_LAYER + r"self_attn\.q_proj\.weight", "layers.{0}.attn.w_q_had"),
    (_LAYER + r"self_attn\.k_proj\.weight", "layers.{0}.attn.w_k_gad"),
    (_LAYER + r"self_attn\.v_proj\.weight", "layers.{0}.attn.w_v_gad"),
    (_LAYER + r"self_attn\.o_proj\.weight", "layers.{0}.attn.w_o_dha"),
    (_LAYER + r"self_attn\.q_proj\.bias", "layers.{0}.attn.b_q_ha"),
    (_LAYER + r"self_attn\.k_proj\.bias", "layers.{0}.attn.b_k_ga"),
    (_LAYER + r"self_attn\.v_proj\.bias", "layers.{0}.attn.b_v_ga"),
    (_LAYER + r"self_attn\.o_proj\.bias", "layers.{0}.attn.b_o_d"),
    (_LAYER + r"self_attn\.q_norm\.weight", "layers.{0}.attn.q_norm.scale"),
    (_LAYER + r"self_attn\.k_norm\.weight", "layers.{0}.attn.k_norm.scale"),
    (_LAYER + r"(?:mlp|block_sparse_moe)\.gate\.weight", "layers.{0}.moe.w_router_ed"),
    (_LAYER + r"mlp\.router\.weight", "layers.{0}.moe.w_router_ed"),
    (_LAYER + r"mlp\.router\.bias", "layers.{0}.moe.b_logits_e"),
    (_LAYER + r"self_attn\.sinks", "layers.{0}.attn.sinks_h"),
    (_LAYER + r"mlp\.shared_expert\.gate_proj\.weight", "layers.{0}.moe.shared.w_gate_id"),
    (_LAYER + r"mlp\.shared_expert\.up_proj\.weight", "layers.{0}.moe.shared.w_up_id"),
    (_LAYER + r"mlp\.shared_expert\.down_proj\.weight", "layers.{0}.moe.shared.w_down_di"),
    (_LAYER + r"mlp\.shared_expert_gate\.weight", "layers.{0}.moe.w_shared_gate_d"),
    # DeepSeek's multi-head latent attention (LatentAttention; q_proj and o_proj as above)
    (_LAYER + r"self_attn\.q_a_proj\.weight", "layers.{0}.attn.w_qa_qd"),
    (_LAYER + r"self_attn\.q_a_layernorm\.weight", "layers.{0}.attn.q_a_norm.scale"),
    (_LAYER + r"self_attn\.q_b_proj\.weight", "layers.{0}.attn.w_qb_hcq"),
    (_LAYER + r"self_attn\.kv_a_proj_with_mqa\.weight", "layers.{0}.attn.w_kva_ld"),
    (_LAYER + r"self_attn\.kv_a_layernorm\.weight", "layers.{0}.attn.kv_a_norm.scale"),
    (_LAYER + r"self_attn\.kv_b_proj\.weight", "layers.{0}.attn.w_kvb_hnr"),
    # GLM's and DeepSeek's ungated shared experts
    (_LAYER + r"mlp\.shared_experts\.gate_proj\.weight", "layers.{0}.moe.shared.w_gate_id"),
    (_LAYER + r"mlp\.shared_experts\.up_proj\.weight", "layers.{0}.moe.shared.w_up_id"),
    (_LAYER + r"mlp\.shared_experts\.down_proj\.weight", "layers.{0}.moe.shared.w_down_di"),
    # the sigmoid router's selection bias: MiniMax's block_sparse_moe (or transformers' mlp),
    # GLM's and DeepSeek's mlp.gate
    (_LAYER + r"(?:mlp|block_sparse_moe)(?:\.gate)?\.e_score_correction_bias",
     "layers.{0}.moe.b_router_e"),
    # a dense MLP layer (ModelConfig.dense_layers)
    (_LAYER + r"mlp\.gate_proj\.weight", "layers.{0}.mlp.w_gate_id"),
    (_LAYER + r"mlp\.up_proj\.weight", "layers.{0}.mlp.w_up_id"),
    (_LAYER + r"mlp\.down_proj\.weight", "layers.{0}.mlp.w_down_di"),
    (_LAYER + r"linear_attn\.in_proj_qkv\.weight", "layers.{0}.linear_attn.w_qkv_xd"),
    (_LAYER + r"linear_attn\.in_proj_z\.weight", "layers.{0}.linear_attn.w_z_myd"),
    (_LAYER + r"linear_attn\.in_proj_b\.weight", "layers.{0}.linear_attn.w_b_md"),
    (_LAYER + r"linear_attn\.in_proj_a\.weight", "layers.{0}.linear_attn.w_a_md"),
    (_LAYER + r"linear_attn\.conv1d\.weight", "layers.{0}.linear_attn.conv_xw"),
    (_LAYER + r"linear_attn\.dt_bias", "layers.{0}.linear_attn.dt_bias_m"),
    (_LAYER + r"linear_attn\.A_log", "layers.{0}.linear_attn.a_log_m"),
    (_LAYER + r"linear_attn\.norm\.weight", "layers.{0}.linear_attn.norm.scale"),
    (_LAYER + r"linear_attn\.out_proj\.weight", "layers.{0}.linear_attn.w_out_dmy"),
]
_DENSE_RULES_RE = [(re.compile(p + "$"), target) for p, target in _DENSE_RULES]

_EXPERT_PART_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                      "w1": "gate", "w3": "up", "w2": "down"}
_PER_EXPERT_RE = re.compile(
    _LAYER + r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
    r"\.weight$")
_FUSED_RE = re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_FUSED_BIAS_RE = re.compile(_LAYER + r"mlp\.experts\.(gate_up_proj|down_proj)_bias$")
_MXFP4_RE = re.compile(_LAYER + r"mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")
# Families whose fused experts are stored [in, out] with gate and up interleaved (see above).
_INTERLEAVED_IN_OUT = ("gpt_oss",)
_IGNORED_RE = re.compile(r"(.*rotary_emb\.inv_freq|visual\..*)$")
# DeepSeek Sparse Attention's indexer (DeepSeek-V3.2, GLM-5): not read (ModelConfig
# sparse_attention_topk: ftjax runs dense latent attention, exact up to index_topk tokens).
_INDEXER_RE = re.compile(_LAYER + r"self_attn\.indexer\..*$")
_MTP_LAYER_RE = re.compile(r"mtp\.layers\.(\d+)\.(.+)$")
_MTP_TOP = {"fc.weight": "mtp.w_fc_dx", "pre_fc_norm_embedding.weight": "mtp.embed_norm.scale",
            "pre_fc_norm_hidden.weight": "mtp.hidden_norm.scale",
            "norm.weight": "mtp.final_norm.scale"}
_QKVZ_RE = re.compile(_LAYER + r"linear_attn\.in_proj_(qkvz|ba)\.weight$")
_GATED_Q_RE = re.compile(_LAYER + r"self_attn\.q_proj\.weight$")


def _strip(name: str) -> str:
  for prefix in ("model.language_model.", "model."):
    if name.startswith(prefix):
      return name[len(prefix):]
  return name


def _split_grouped(config: ModelConfig, layer: int, kind: str, w: np.ndarray):
  """Qwen3-Next's fused projections -> the split parameters. Rows come per key head: ``qkvz``
  [J·(2U + 2R·Y), D] holds q (U rows), k (U), v (R·Y), z (R·Y) for each of the J key heads
  (R = M/J value heads per key head); ``ba`` [J·2R, D] holds b (R), then a (R)."""
  j, u, y = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
  r = config.linear_num_value_heads // j
  d = w.shape[-1]
  prefix = f"layers.{layer}.linear_attn."
  if kind == "qkvz":
    parts = np.asarray(w).reshape(j, 2 * u + 2 * r * y, d)
    q, k = parts[:, :u], parts[:, u:2 * u]
    v, z = parts[:, 2 * u:2 * u + r * y], parts[:, 2 * u + r * y:]
    qkv = np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])
    yield "dense", prefix + "w_qkv_xd", qkv
    yield "dense", prefix + "w_z_myd", z.reshape(-1, d)
  else:
    parts = np.asarray(w).reshape(j, 2 * r, d)
    yield "dense", prefix + "w_b_md", parts[:, :r].reshape(-1, d)
    yield "dense", prefix + "w_a_md", parts[:, r:].reshape(-1, d)


def expected_dense_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """ftjax parameter path -> shape, from the model definition itself."""
  return {name: tuple(v.shape) for name, v in abstract_params(config).items()}


def mtp_layers_in(names: Iterable[str]) -> int:
  """MTP layers of a checkpoint, counted from its ``mtp.layers.{j}.`` tensor names."""
  found = [int(m[1]) for n in names if (m := _MTP_LAYER_RE.match(_strip(n)))]
  return max(found) + 1 if found else 0


def _tensor_plan(st: SafetensorsFile, name: str, config: ModelConfig,
                 find: Callable[[str], np.ndarray] | None = None) -> Iterator[tuple[str, Any]]:
  """Yields ("dense", path, array), ("expert", (layer, expert, part), array) or, for MXFP4
  experts, ("expert", (layer, expert, part), (codes, scales)) items. ``find(name)`` reads a
  tensor from any shard (an MXFP4 weight's scales, met with its blocks)."""
  short = _strip(name)
  if _IGNORED_RE.match(short) or (config.sparse_attention_topk and _INDEXER_RE.match(short)):
    return
  m = re.match(_LAYER, short)
  if m and int(m[1]) >= config.num_layers:
    yield from _deepseek_mtp_plan(st, name, int(m[1]) - config.num_layers,
                                  short[m.end():], config, find)
    return
  if short.startswith("mtp."):
    yield from _mtp_plan(st, name, short, config, find)
    return
  yield from _layer_plan(st, name, short, config, find)


def _mtp_plan(st, name: str, short: str, config: ModelConfig, find):
  """An MTP tensor: the head's own (``_MTP_TOP``), or one of MTP layer j's, planned as bank and
  parameter layer ``num_layers + j`` and renamed ``mtp.layers.{j}.*``."""
  if short[len("mtp."):] in _MTP_TOP:
    yield "dense", _MTP_TOP[short[len("mtp."):]], st.get(name)
    return
  m = _MTP_LAYER_RE.match(short)
  if m is None:
    raise ConversionError(f"unexpected MTP tensor {name} in {st.path}: ftjax knows mtp.fc, "
                          "mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm and "
                          "mtp.layers.{j}.*")
  j = int(m[1])
  if j >= config.mtp_layers:
    raise ConversionError(f"tensor {name}: MTP layer {j}, but the config has {config.mtp_layers}")
  layer = config.num_layers + j
  for kind, where, array in _layer_plan(st, name, f"layers.{layer}.{m[2]}", config, find):
    if kind == "dense":
      where = f"mtp.layers.{j}." + where[len(f"layers.{layer}."):]
    yield kind, where, array


# DeepSeek's MTP module j (``model.layers.{num_hidden_layers + j}.``): its own parts, as the
# MTPHead names them; the rest of its tensors are a decoder layer's.
_DEEPSEEK_MTP_TOP = {"enorm.weight": "mtp.embed_norm.scale", "hnorm.weight": "mtp.hidden_norm.scale",
                     "eh_proj.weight": "mtp.w_fc_dx", "shared_head.norm.weight": "mtp.final_norm.scale"}
# Copies of the model's embedding and lm_head that each MTP module ships (checked, not kept).
_DEEPSEEK_MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight",
                        "shared_head.head.weight": "lm_head.weight"}


def _deepseek_mtp_plan(st, name: str, j: int, rest: str, config: ModelConfig, find):
  """A tensor of MTP module j in DeepSeek's layout (``rest``: its name after the layer's
  prefix): the head's norms and projection, its decoder layer (planned as parameter and bank
  layer ``num_layers + j`` and renamed ``mtp.layers.{j}.*``), or its copies of the embedding
  and lm_head, which must equal the model's (the head reads the model's)."""
  if j >= config.mtp_layers:
    raise ConversionError(f"tensor {name}: MTP module {j}, but the config has "
                          f"{config.mtp_layers} (num_nextn_predict_layers)")
  if rest in _DEEPSEEK_MTP_TOP:
    yield "dense", _DEEPSEEK_MTP_TOP[rest], st.get(name)
    return
  if rest in _DEEPSEEK_MTP_SHARED:
    _check_shared_copy(name, st.get(name), _DEEPSEEK_MTP_SHARED[rest], config, find)
    return
  yield from _mtp_plan(st, name, f"mtp.layers.{j}.{rest}", config, find)


def _check_shared_copy(name: str, copy: np.ndarray, original: str, config: ModelConfig, find):
  """An MTP module's copy of the embedding or lm_head must be the model's: compares rows at
  both ends and a stride through the middle (cheap on a 1 GB table, and a different table
  differs in nearly every row)."""
  if original == "lm_head.weight" and config.tie_word_embeddings:
    original = "model.embed_tokens.weight"
  if find is None:
    raise ConversionError(f"tensor {name}: the MTP module's copy of {original} needs it to compare")
  source = find(original)
  rows = np.unique(np.r_[0:min(8, len(source)), max(len(source) - 8, 0):len(source),
                         0:len(source):max(len(source) // 64, 1)])
  if copy.shape != source.shape or not np.array_equal(np.asarray(copy[rows]),
                                                       np.asarray(source[rows])):
    raise ConversionError(
        f"tensor {name} is not a copy of {original}: ftjax's MTP head reads the model's "
        "embedding and lm_head, and a head with its own is not supported")


def _bank_layer(config: ModelConfig, name: str, layer: str) -> int:
  """The expert-bank layer of routed-expert tensor ``name`` of decoder layer ``layer``."""
  bank = config.bank_layer(int(layer))
  if bank is None:
    raise ConversionError(
        f"tensor {name}: routed experts in decoder layer {layer}, which this config makes a "
        f"dense MLP layer (dense layers {list(config.dense_layers)}: check first_k_dense_replace, "
        "mlp_only_layers or decoder_sparse_step in config.json)")
  return bank


def deepseek_mtp_layers_in(names: Iterable[str], config: ModelConfig) -> int:
  """MTP modules of a checkpoint in DeepSeek's layout (GLM-4.5+, DeepSeek-V3): the decoder
  layers past ``num_hidden_layers``, ``model.layers.{L + j}`` (``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head`` and a MoE layer), which transformers does not load."""
  found = {int(m[1]) for n in names if (m := re.match(_LAYER, _strip(n)))
           and int(m[1]) >= config.num_layers}
  return max(found) - config.num_layers + 1 if found else 0


def _layer_plan(st, name: str, short: str, config: ModelConfig, find):
  """The plan of a model tensor whose name, after the leading ``model.``, is ``short``."""
  m = _QKVZ_RE.match(short)
  if m:
    yield from _split_grouped(config, int(m[1]), m[2], st.get(name))
    return
  m = _GATED_Q_RE.match(short)
  if m and config.attn_output_gate:
    h, a = config.num_heads, config.head_dim
    w = st.get(name)
    if w.shape[0] != 2 * h * a:
      raise ftw.FTWConfigMismatchError(
          f"tensor {name} has shape {tuple(w.shape)}; a gated attention's q_proj needs "
          f"2·num_attention_heads·head_dim = {2 * h * a} rows (query and gate per head)")
    per_head = w.reshape(h, 2, a, w.shape[-1])
    yield "dense", f"layers.{m[1]}.attn.w_q_had", per_head[:, 0]
    yield "dense", f"layers.{m[1]}.attn.w_gate_had", per_head[:, 1]
    return
  m = _PER_EXPERT_RE.match(short)
  if m:
    where = (_bank_layer(config, name, m[1]), int(m[2]), _EXPERT_PART_NAMES[m[3]])
    yield "expert", where, st.get(name)
    return
  m = _MXFP4_RE.match(short)
  if m:
    if m[3] == "blocks":  # the scales are read with their blocks
      scales_name = name[:-len("blocks")] + "scales"
      if find is None:
        raise ConversionError(f"tensor {name}: MXFP4 blocks need their scales {scales_name}")
      yield from _mxfp4_experts(config, name, _bank_layer(config, name, m[1]), m[2], st.get(name), find(scales_name))
    return
  m = _FUSED_BIAS_RE.match(short)
  if m:
    yield from _interleaved_biases(config, name, _bank_layer(config, name, m[1]), m[2], st.get(name))
    return
  m = _FUSED_RE.match(short)
  if m and config.model_type in _INTERLEAVED_IN_OUT:
    yield from _interleaved_in_out(config, name, _bank_layer(config, name, m[1]), m[2], st.get(name))
    return
  if m:
    layer, kind = _bank_layer(config, name, m[1]), m[2]
    fused = st.get(name)  # [E, 2F, D] or [E, D, F], still a memmap view
    if fused.ndim != 3:
      raise ConversionError(f"fused expert tensor {name} should be 3-D, has shape {fused.shape}")
    for e in range(fused.shape[0]):
      if kind == "gate_up_proj":
        half = fused.shape[1] // 2
        yield "expert", (layer, e, "gate"), fused[e, :half]
        yield "expert", (layer, e, "up"), fused[e, half:]
      else:
        yield "expert", (layer, e, "down"), fused[e]
    return
  for pattern, target in _DENSE_RULES_RE:
    m = pattern.match(short)
    if m:
      yield "dense", target.format(*m.groups()), st.get(name)
      return
  raise ConversionError(
      f"unexpected tensor {name} in {st.path}: ftjax does not know where it belongs for this "
      "architecture (is the model_type in config.json right?)")


def _interleaved_in_out(config: ModelConfig, name: str, layer: int, kind: str, fused):
  """gpt-oss's fused experts: ``gate_up_proj`` [E, D, 2F] (gate in the even columns, up in the
  odd ones) and ``down_proj`` [E, F, D] -> each expert's gate [F, D], up [F, D], down [D, F]."""
  e, f, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
  want = (e, d, 2 * f) if kind == "gate_up_proj" else (e, f, d)
  if tuple(fused.shape) != want:
    raise ftw.FTWConfigMismatchError(
        f"tensor {name} has shape {tuple(fused.shape)}; {config.model_type} stores it [E, "
        f"{'D, 2F' if kind == 'gate_up_proj' else 'F, D'}] = {want} for this config.json")
  for expert in range(e):
    if kind == "gate_up_proj":
      yield "expert", (layer, expert, "gate"), fused[expert, :, 0::2].T
      yield "expert", (layer, expert, "up"), fused[expert, :, 1::2].T
    else:
      yield "expert", (layer, expert, "down"), fused[expert].T


def _mxfp4_experts(config: ModelConfig, name: str, layer: int, kind: str, blocks, scales):
  """gpt-oss's MXFP4 experts (module docstring) -> each expert's gate, up and down codes
  [out, in/2] with their E8M0 scales [out, in/32]."""
  e, f, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
  if config.model_type not in _INTERLEAVED_IN_OUT:
    raise ConversionError(f"tensor {name}: MXFP4 experts are read for gpt-oss checkpoints only, "
                          f"this one is {config.model_type}")
  rows, cols = (2 * f, d) if kind == "gate_up_proj" else (d, f)
  want = (e, rows, cols // 32, 16)
  if tuple(blocks.shape) != want or tuple(scales.shape) != want[:3]:
    raise ftw.FTWConfigMismatchError(
        f"tensor {name} has shape {tuple(blocks.shape)} with scales {tuple(scales.shape)}; for "
        f"this config.json MXFP4 {kind} is blocks {want} and scales {want[:3]}")
  if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
    raise ConversionError(f"tensor {name}: MXFP4 blocks and scales must be uint8 (U8), got "
                          f"{blocks.dtype} and {scales.dtype}")
  for expert in range(e):
    codes = blocks[expert].reshape(rows, cols // 2)
    if kind == "gate_up_proj":
      yield "expert", (layer, expert, "gate"), (codes[0::2], scales[expert, 0::2])
      yield "expert", (layer, expert, "up"), (codes[1::2], scales[expert, 1::2])
    else:
      yield "expert", (layer, expert, "down"), (codes, scales[expert])


def _interleaved_biases(config: ModelConfig, name: str, layer: int, kind: str, bias):
  """gpt-oss's expert biases: ``gate_up_proj_bias`` [E, 2F] (interleaved like the weights) and
  ``down_proj_bias`` [E, D] -> each expert's gate, up and down bias parts."""
  e, f, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
  if not config.expert_bias:
    raise ConversionError(f"tensor {name}: expert biases, which this {config.model_type} config "
                          "does not have")
  want = (e, 2 * f) if kind == "gate_up_proj" else (e, d)
  if tuple(bias.shape) != want:
    raise ftw.FTWConfigMismatchError(
        f"tensor {name} has shape {tuple(bias.shape)}, not the {want} implied by config.json")
  for expert in range(e):
    if kind == "gate_up_proj":
      yield "expert", (layer, expert, "gate_bias"), bias[expert, 0::2]
      yield "expert", (layer, expert, "up_bias"), bias[expert, 1::2]
    else:
      yield "expert", (layer, expert, "down_bias"), bias[expert]


def _with_mtp_layers(config: ModelConfig, found: int, hf_dir: str) -> ModelConfig:
  """The config with the MTP layers the checkpoint has: Qwen3-Next's config.json does not name
  them; a re-upload may have dropped the tensors its config names (converted without them)."""
  if found == config.mtp_layers:
    return config
  deepseek = config.model_type in DEEPSEEK_MTP_MODEL_TYPES
  where = (f"model.layers.{config.num_layers}.*" if deepseek else "mtp.*")
  if found == 0:
    print(f"ftjax: {hf_dir}: config.json names {config.mtp_layers} multi-token-prediction (MTP) "
          f"layers but the checkpoint has no {where} tensors; converting without MTP",
          file=sys.stderr)
  elif config.mtp_layers:
    key = "num_nextn_predict_layers" if deepseek else "mtp_num_hidden_layers"
    raise ConversionError(
        f"{hf_dir}: config.json names {config.mtp_layers} MTP layers but the checkpoint has "
        f"{found} ({where}); fix {key} in config.json")
  return dataclasses.replace(config, mtp_layers=found)


def convert_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16",
               *, expert_dtype: str | None = None, dense_dtype: str | None = None,
               overwrite: bool = False, show_progress: bool = True) -> str:
  """Converts a Hugging Face MoE checkpoint directory to an FTW directory; returns its path.

  ``dtype`` is the storage dtype of the dense tensors, ``expert_dtype`` the routed experts'
  format (default ``dtype``, or ``"mxfp4"`` for a checkpoint with MXFP4 experts): ``"int8"``
  quantises them symmetrically per output channel with float32 scales
  (``ftjax.utils.quant``), from whatever float dtype the checkpoint has; ``"mxfp4"`` keeps
  gpt-oss's MXFP4 experts as shipped, or quantises float experts (any family) to it: per
  block of 32 inputs the smallest power-of-two scale that fits E2M1's 6, each weight rounded
  to the nearest E2M1 value (``quant.quantize_mxfp4``); ``"int4"`` quantises float experts to
  unsigned 4-bit codes with a scale and a min per 32 inputs (``quant.quantize_int4``).
  ``dense_dtype`` (``ftw.DENSE_DTYPES``: ``"int8"``, ``"int4"``, ``"mxfp4"`` or the
  ``"mixed4"`` / ``"mixed_int4"`` presets) quantises the dense matrices outside the experts
  (``ftw.dense_format`` says which get what; docs/ftw.md, "Dense formats"); a matrix that
  cannot take the format asked for is named on stderr with the one it got.

  Writes into a temporary directory next to ``out_dir`` and renames it at the end, so an
  interrupted conversion never leaves a half-written model and never touches other files.
  """
  hf_dir, out_dir = os.fspath(hf_dir), os.path.abspath(os.fspath(out_dir))
  if not os.path.isdir(hf_dir):
    raise FileNotFoundError(f"--hf_dir {hf_dir} is not a directory")
  ftw.storage_dtype(dtype)  # validates the names
  if expert_dtype is not None:
    ftw.expert_storage_dtype(expert_dtype)
  ftw.dense_format(dense_dtype, "", (), False)  # validates the name
  config = ModelConfig.from_hf_dir(hf_dir)
  if os.path.exists(out_dir):
    if not (overwrite and ftw.is_ftw_dir(out_dir)):
      raise FileExistsError(
          f"--out {out_dir} already exists; choose a new directory"
          + (" or pass overwrite=True (--overwrite) to replace this FTW model"
             if ftw.is_ftw_dir(out_dir) else " (it is not an FTW model, so ftjax never replaces it)"))
  shards = [SafetensorsFile(p) for p in _shard_paths(hf_dir)]
  names = [n for st in shards for n in st.keys()]
  if config.sparse_attention_topk and any(_INDEXER_RE.match(_strip(n)) for n in names):
    print(f"ftjax: {hf_dir}: the DeepSeek Sparse Attention indexer (self_attn.indexer.*) is not "
          f"converted: ftjax runs dense latent attention, exact up to index_topk="
          f"{config.sparse_attention_topk} tokens of context, its limit", file=sys.stderr)
  if config.model_type in DEEPSEEK_MTP_MODEL_TYPES:
    config = _with_mtp_layers(config, deepseek_mtp_layers_in(names, config), hf_dir)
  else:
    config = _with_mtp_layers(config, mtp_layers_in(names), hf_dir)
    if deepseek_mtp_layers_in(names, config):
      raise ConversionError(
          f"{hf_dir}: tensors of decoder layers past num_hidden_layers={config.num_layers}, "
          f"which a {config.model_type} checkpoint does not have: check num_hidden_layers")
  with open(os.path.join(hf_dir, "config.json")) as f:
    hf_config = json.load(f)
  quant = (hf_config.get("quantization_config") or {}).get("quant_method")
  # MXFP4 experts are their *_blocks tensors (a checkpoint that transformers dequantised may
  # keep quant_method "mxfp4" in its config, with float experts).
  mxfp4 = any(_MXFP4_RE.match(_strip(n)) for st in shards for n in st.keys())
  if quant not in (None, "mxfp4", "fp8") or (quant != "mxfp4" and mxfp4):
    raise ConversionError(f"{hf_dir}: quantization_config.quant_method={quant!r} with "
                          f"{'MXFP4 *_blocks' if mxfp4 else 'these'} tensors: ftjax reads float "
                          "checkpoints, block-scaled FP8 (quant_method 'fp8') and gpt-oss's "
                          "MXFP4 (quant_method 'mxfp4')")
  shards = fp8.dequantising_shards(hf_dir, hf_config, shards)  # FP8 weights read as float32
  if mxfp4:
    if expert_dtype not in (None, "mxfp4"):
      raise ConversionError(
          f"{hf_dir} ships MXFP4 experts, which are kept as they are (--expert_dtype=mxfp4, the "
          f"default for it); --expert_dtype={expert_dtype} would need them dequantised, which "
          "ftjax does not do: convert a bf16 copy (transformers' Mxfp4Config(dequantize=True), "
          "then save_pretrained) for that")
    expert_dtype = "mxfp4"
  source = {"kind": "huggingface-safetensors", "fingerprint": fingerprint(hf_dir),
            "path": os.path.abspath(hf_dir), "hf_config": hf_config}
  shapes = expected_dense_shapes(config)

  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp_dir = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".partial-", dir=parent)
  try:
    writer = ftw.FTWWriter(tmp_dir, config, dtype, source, expert_format=expert_dtype,
                           dense_dtype=dense_dtype)
    total_bytes = sum(st.nbytes(n) for st in shards for n in st.keys())
    shard_of = {n: st for st in shards for n in st.keys()}

    def find(tensor: str) -> np.ndarray:
      if tensor not in shard_of:
        raise ConversionError(f"the checkpoint in {hf_dir} has no tensor {tensor}")
      return shard_of[tensor].get(tensor)

    bar = Progress(total_bytes, desc="convert", unit="B", enabled=show_progress)
    for st in shards:
      for name in st.keys():
        for kind, where, array in _tensor_plan(st, name, config, find):
          if kind == "expert" and isinstance(array, tuple):  # mxfp4 codes and scales
            writer.add_expert_part(*where, *array)
            array = array[0]
          elif kind == "expert":
            writer.add_expert_part(*where, array)
          elif where == "w_lm_vd" and config.tie_word_embeddings:
            pass  # a tied checkpoint may still store a copy of the embedding as lm_head
          else:
            if where not in shapes:
              raise ConversionError(
                  f"tensor {name} maps to {where}, which this {config.model_type} config does not "
                  "have (check config.json: biases, shared experts, tie_word_embeddings)")
            if int(np.prod(array.shape)) != int(np.prod(shapes[where])):
              raise ftw.FTWConfigMismatchError(
                  f"tensor {name} has shape {tuple(array.shape)}, which does not match the "
                  f"{shapes[where]} implied by config.json")
            writer.add_tensor(where, array.reshape(shapes[where]))
          bar.update(array.nbytes)
    bar.close()
    missing = sorted(set(shapes) - set(writer.tensors))
    if missing:
      raise ConversionError(f"the checkpoint is missing tensors {missing[:5]}"
                            + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    for name, why in writer.dense_notes.items():
      print(f"ftjax.convert: {name}: {why}", file=sys.stderr)
    writer.close()
    for name in TOKENIZER_FILES:
      src = os.path.join(hf_dir, name)
      if os.path.isfile(src):
        shutil.copy2(src, os.path.join(tmp_dir, name))
    if os.path.exists(out_dir):
      shutil.rmtree(out_dir)  # only reached for an FTW directory with overwrite=True
    os.replace(tmp_dir, out_dir)
  except BaseException:
    shutil.rmtree(tmp_dir, ignore_errors=True)
    raise
  return out_dir


def cached_conversion(hf_dir: str | os.PathLike, *, dtype: str = "bfloat16",
                      cache_root: str | None = None,
                      log: Callable[[str], None] = print) -> str:
  """FTW directory for a Hugging Face checkpoint, converted once into a cache directory.

  The cache entry is keyed by the checkpoint's fingerprint, so an edited checkpoint is
  converted again instead of serving stale weights.
  """
  cache_root = cache_root or paths.cache_root()
  fp = fingerprint(hf_dir)
  out = os.path.join(cache_root, f"{fp.split(':')[1][:24]}-{dtype}")
  if ftw.is_ftw_dir(out):
    with open(os.path.join(out, ftw.INDEX_NAME)) as f:
      if json.load(f).get("source", {}).get("fingerprint") == fp:
        return out
  log(f"converting {hf_dir} to FTW ({dtype}) in {out} (once)")
  return convert_hf(hf_dir, out, dtype=dtype, overwrite=True)
