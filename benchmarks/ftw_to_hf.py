"""FTW -> Hugging Face checkpoint for the qwen3_5_moe family: the inverse of ftjax's importer.

``export_hf(ftw_dir, hf_dir)`` writes an ftjax FTW model of the ``qwen3_5_moe`` family (the
hybrid Gated-DeltaNet MoE of Qwen3.5/3.6), its multi-token-prediction (MTP) head ``mtp.*``
included when the model has one, as a text-only ``Qwen3_5MoeForCausalLM`` checkpoint:

- ``config.json``: model_type ``qwen3_5_moe_text``, the keys ``ModelConfig.from_hf_config``
  reads (``mtp_num_hidden_layers`` for the MTP layers; ``rope_parameters`` without an
  ``mrope_section``, which llama.cpp's converter then fills with its default);
- ``model-*.safetensors`` with ``model.safetensors.index.json``: one shard for the embedding,
  final norm, lm_head (absent when the embeddings are tied) and the MTP head's own tensors,
  then one shard per decoder layer and per MTP layer;
- ``tokenizer.json`` and ``tokenizer_config.json`` (and the other tokenizer files ftjax
  copies) from the FTW directory.

Every tensor is written as it is stored in the FTW (same dtype, same bits); the layout is the
one ``ftjax.formats.hf`` reads:

- dense tensors are reshaped back to the HF shapes (``w_k_gad`` [G, A, D] -> ``k_proj``
  [G·A, D], ``w_o_dha`` [D, H, A] -> ``o_proj`` [D, H·A], ``conv_xw`` [X, W] -> ``conv1d``
  [X, 1, W], ``w_shared_gate_d`` [D] -> ``shared_expert_gate`` [1, D], ...); no transposes;
- a gated attention's ``q_proj`` [2·H·A, D] holds per head the query (``w_q_had``) then its
  output gate (``w_gate_had``);
- Gated DeltaNet: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` split (Qwen3.5
  style), ``A_log`` and ``dt_bias`` as stored;
- RMSNorm weights are zero-centred in both formats (the model scales by 1 + w), the gated
  DeltaNet norm is a plain weight in both: written as stored;
- routed experts per expert: ``mlp.experts.{e}.{gate,up,down}_proj.weight`` from the bank's
  gate [F, D], up [F, D] and down [D, F] parts;
- the MTP head: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
  ``mtp.norm`` from ``mtp.w_fc_dx``, ``mtp.embed_norm``, ``mtp.hidden_norm``,
  ``mtp.final_norm``; ``mtp.layers.{j}.*`` named as a decoder layer's, whose experts are bank
  layer ``num_layers + j``.

``check_round_trip(ftw_dir, hf_dir)`` converts the exported directory back with ftjax's own
converter (``ftjax.formats.hf.convert_hf``, into a temporary directory) and asserts that the
model configs agree and every dense tensor and expert part is bit-identical to the
original's, naming the first one that is not.

Float banks only (bfloat16 or float32): int8 and mxfp4 experts have no HF float form here.

  /work/venv/bin/python benchmarks/ftw_to_hf.py FTW_DIR HF_DIR [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile

import numpy as np

# ftjax's name (after "layers.{i}." or "mtp.layers.{j}.") -> the HF name of a decoder layer's
# tensor (after "model.layers.{i}." or "mtp.layers.{j}."). Gated attention's w_q_had and
# w_gate_had are fused into q_proj apart from this table.
_LAYER_NAMES = {
    "attn_norm.scale": "input_layernorm.weight",
    "mlp_norm.scale": "post_attention_layernorm.weight",
    "attn.w_k_gad": "self_attn.k_proj.weight",
    "attn.w_v_gad": "self_attn.v_proj.weight",
    "attn.w_o_dha": "self_attn.o_proj.weight",
    "attn.q_norm.scale": "self_attn.q_norm.weight",
    "attn.k_norm.scale": "self_attn.k_norm.weight",
    "moe.w_router_ed": "mlp.gate.weight",
    "moe.shared.w_gate_id": "mlp.shared_expert.gate_proj.weight",
    "moe.shared.w_up_id": "mlp.shared_expert.up_proj.weight",
    "moe.shared.w_down_di": "mlp.shared_expert.down_proj.weight",
    "moe.w_shared_gate_d": "mlp.shared_expert_gate.weight",
    "linear_attn.w_qkv_xd": "linear_attn.in_proj_qkv.weight",
    "linear_attn.w_z_myd": "linear_attn.in_proj_z.weight",
    "linear_attn.w_b_md": "linear_attn.in_proj_b.weight",
    "linear_attn.w_a_md": "linear_attn.in_proj_a.weight",
    "linear_attn.conv_xw": "linear_attn.conv1d.weight",
    "linear_attn.dt_bias_m": "linear_attn.dt_bias",
    "linear_attn.a_log_m": "linear_attn.A_log",
    "linear_attn.norm.scale": "linear_attn.norm.weight",
    "linear_attn.w_out_dmy": "linear_attn.out_proj.weight",
}
_GATED_Q = ("attn.w_q_had", "attn.w_gate_had")
# Tensors outside the decoder layers.
_TOP_NAMES = {
    "embed_vd": "model.embed_tokens.weight",
    "final_norm.scale": "model.norm.weight",
    "w_lm_vd": "lm_head.weight",
    "mtp.w_fc_dx": "mtp.fc.weight",
    "mtp.embed_norm.scale": "mtp.pre_fc_norm_embedding.weight",
    "mtp.hidden_norm.scale": "mtp.pre_fc_norm_hidden.weight",
    "mtp.final_norm.scale": "mtp.norm.weight",
}
_EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_LAYER_RE = re.compile(r"(mtp\.layers|layers)\.(\d+)\.(.+)$")
_SUPPORTED = ("qwen3_5_moe",)


class ExportError(ValueError):
  """The FTW model cannot be written as a qwen3_5_moe Hugging Face checkpoint."""


def _hf_shapes(c) -> dict[str, tuple[int, ...]]:
  """HF name suffix -> shape of a decoder layer's tensors, and the top-level shapes."""
  d, h, g, a = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
  x, m, y = c.linear_conv_dim, c.linear_num_value_heads, c.linear_value_head_dim
  i, e, v = c.shared_expert_intermediate_size, c.num_experts, c.vocab_size
  return {
      "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
      "self_attn.q_proj.weight": (2 * h * a, d), "self_attn.k_proj.weight": (g * a, d),
      "self_attn.v_proj.weight": (g * a, d), "self_attn.o_proj.weight": (d, h * a),
      "self_attn.q_norm.weight": (a,), "self_attn.k_norm.weight": (a,),
      "mlp.gate.weight": (e, d), "mlp.shared_expert.gate_proj.weight": (i, d),
      "mlp.shared_expert.up_proj.weight": (i, d), "mlp.shared_expert.down_proj.weight": (d, i),
      "mlp.shared_expert_gate.weight": (1, d),
      "linear_attn.in_proj_qkv.weight": (x, d), "linear_attn.in_proj_z.weight": (m * y, d),
      "linear_attn.in_proj_b.weight": (m, d), "linear_attn.in_proj_a.weight": (m, d),
      "linear_attn.conv1d.weight": (x, 1, c.linear_conv_kernel),
      "linear_attn.dt_bias": (m,), "linear_attn.A_log": (m,), "linear_attn.norm.weight": (y,),
      "linear_attn.out_proj.weight": (d, m * y),
      "model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d),
      "mtp.fc.weight": (d, 2 * d), "mtp.pre_fc_norm_embedding.weight": (d,),
      "mtp.pre_fc_norm_hidden.weight": (d,), "mtp.norm.weight": (d,),
  }


def hf_config(c) -> dict:
  """config.json of the text-only ``Qwen3_5MoeForCausalLM`` whose ``from_hf_config`` gives
  ``c`` back (``ftjax.model.config``)."""
  if c.model_type not in _SUPPORTED:
    raise ExportError(f"model_type {c.model_type!r}: this exporter writes {_SUPPORTED} models")
  fixed = dict(qk_norm="per_head", norm_zero_centred=True, attn_output_gate=True,
               shared_expert_gate=True, norm_topk_prob=True, router="softmax_topk",
               qkv_bias=False, o_bias=False, expert_bias=False, yarn=None,
               sliding_window=None, vision_token_ids=())
  odd = {k: getattr(c, k) for k, v in fixed.items() if getattr(c, k) != v}
  if odd or not c.shared_expert_intermediate_size:
    raise ExportError(f"options a qwen3_5_moe checkpoint cannot express: {odd or 'no shared expert'}")
  out = {
      "architectures": ["Qwen3_5MoeForCausalLM"],
      "model_type": "qwen3_5_moe_text",
      "vocab_size": c.vocab_size,
      "hidden_size": c.hidden_size,
      "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads,
      "head_dim": c.head_dim,
      "hidden_act": "silu",
      "attention_bias": False,
      "attention_dropout": 0.0,
      "attn_output_gate": True,
      "num_experts": c.num_experts,
      "num_experts_per_tok": c.top_k,
      "moe_intermediate_size": c.moe_intermediate_size,
      "shared_expert_intermediate_size": c.shared_expert_intermediate_size,
      "router_aux_loss_coef": 0.001,
      "output_router_logits": False,
      "rms_norm_eps": c.rms_norm_eps,
      "max_position_embeddings": c.max_position_embeddings,
      "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                          "partial_rotary_factor": c.partial_rotary_factor},
      "layer_types": list(c.layer_types),
      "full_attention_interval": _attention_interval(c.layer_types),
      "linear_num_key_heads": c.linear_num_key_heads,
      "linear_num_value_heads": c.linear_num_value_heads,
      "linear_key_head_dim": c.linear_key_head_dim,
      "linear_value_head_dim": c.linear_value_head_dim,
      "linear_conv_kernel_dim": c.linear_conv_kernel,
      "mtp_num_hidden_layers": c.mtp_layers,
      "tie_word_embeddings": c.tie_word_embeddings,
      "dtype": c.source_dtype,
      "initializer_range": 0.02,
      "use_cache": True,
  }
  if c.eos_token_ids:
    ids = list(c.eos_token_ids)
    out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
  return out


def _attention_interval(layer_types) -> int:
  """``full_attention_interval`` matching ``layer_types`` when it is regular (what readers
  that ignore layer_types use), else 4 (transformers' default)."""
  for n in range(1, len(layer_types) + 1):
    if all((t == "full_attention") == ((i + 1) % n == 0) for i, t in enumerate(layer_types)):
      return n
  return 4


def _to_torch(array: np.ndarray):
  """A torch tensor with the same bits (bfloat16 through a uint16 view)."""
  import torch  # noqa: PLC0415
  array = np.ascontiguousarray(array)
  if array.dtype.name == "bfloat16":
    return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
  return torch.from_numpy(array.copy())


def _plan(f) -> tuple[dict[str, dict[str, np.ndarray]], list[str]]:
  """Shard name stem -> {HF name: array}, for every tensor of the FTW file ``f``, and the
  names of the shards in order."""
  c = f.config
  if f.expert_format not in ("bfloat16", "float32"):
    raise ExportError(f"{f.path} stores {f.expert_format} experts; export needs float experts")
  shapes = _hf_shapes(c)
  groups: dict[str, dict[str, np.ndarray]] = {"top": {}}
  order = ["top"] + [f"layer{i}" for i in range(c.num_layers)] + [
      f"mtp{j}" for j in range(c.mtp_layers)]
  for stem in order[1:]:
    groups[stem] = {}
  pending_q: dict[str, dict[str, np.ndarray]] = {}

  def hf_array(hf_name: str, suffix: str, value: np.ndarray) -> np.ndarray:
    want = shapes[suffix]
    if int(np.prod(want)) != value.size:
      raise ExportError(f"{hf_name}: {value.size} elements, the config implies {want}")
    return value.reshape(want)

  for name in f.tensor_names():
    value = f.tensor(name)
    if name in _TOP_NAMES:
      hf = _TOP_NAMES[name]
      groups["top"][hf] = hf_array(hf, hf, value)
      continue
    m = _LAYER_RE.match(name)
    if m is None:
      raise ExportError(f"tensor {name} has no qwen3_5_moe Hugging Face name")
    kind, index, rest = m[1], int(m[2]), m[3]
    prefix = f"model.layers.{index}." if kind == "layers" else f"mtp.layers.{index}."
    stem = f"layer{index}" if kind == "layers" else f"mtp{index}"
    if rest in _GATED_Q:
      pending_q.setdefault(prefix, {})[rest] = value
      if len(pending_q[prefix]) == 2:
        parts = pending_q.pop(prefix)
        q, gate = parts["attn.w_q_had"], parts["attn.w_gate_had"]  # [H, A, D] each
        fused = np.stack([q, gate], axis=1)  # [H, 2, A, D]: per head the query, then its gate
        hf = prefix + "self_attn.q_proj.weight"
        groups[stem][hf] = hf_array(hf, "self_attn.q_proj.weight", fused)
      continue
    if rest not in _LAYER_NAMES:
      raise ExportError(f"tensor {name} has no qwen3_5_moe Hugging Face name")
    hf = prefix + _LAYER_NAMES[rest]
    groups[stem][hf] = hf_array(hf, _LAYER_NAMES[rest], value)
  if pending_q:
    raise ExportError(f"gated attention without both w_q_had and w_gate_had: {sorted(pending_q)}")
  for layer in range(c.num_moe_layers):
    if layer < c.num_layers:
      stem, prefix = f"layer{layer}", f"model.layers.{layer}.mlp.experts."
    else:
      j = layer - c.num_layers
      stem, prefix = f"mtp{j}", f"mtp.layers.{j}.mlp.experts."
    for e in range(c.num_experts):
      for part, hf_part in _EXPERT_NAMES.items():
        groups[stem][f"{prefix}{e}.{hf_part}.weight"] = f.expert_part(layer, e, part)
  return groups, order


def export_hf(ftw_dir: str | os.PathLike, hf_dir: str | os.PathLike, *,
              overwrite: bool = False) -> str:
  """Writes the FTW model at ``ftw_dir`` as a Hugging Face ``Qwen3_5MoeForCausalLM``
  checkpoint directory ``hf_dir`` (module docstring) and returns its path. Writes into
  ``hf_dir.partial`` and renames it at the end; an existing ``hf_dir`` is replaced only with
  ``overwrite``."""
  from safetensors.torch import save_file  # noqa: PLC0415

  from ftjax.formats import ftw  # noqa: PLC0415
  from ftjax.formats.hf import TOKENIZER_FILES  # noqa: PLC0415

  ftw_dir, hf_dir = os.fspath(ftw_dir), os.path.abspath(os.fspath(hf_dir))
  if os.path.exists(hf_dir) and not overwrite:
    raise FileExistsError(f"{hf_dir} exists; pass overwrite=True to replace it")
  f = ftw.FTWFile.open(ftw_dir, verify=False)
  config = hf_config(f.config)
  groups, order = _plan(f)
  tmp = hf_dir + ".partial"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  weight_map, total = {}, 0
  names = [f"model-{i + 1:05d}-of-{len(order):05d}.safetensors" for i in range(len(order))]
  for shard, stem in zip(names, order):
    tensors = {n: _to_torch(a) for n, a in groups[stem].items()}
    save_file(tensors, os.path.join(tmp, shard), metadata={"format": "pt"})
    total += sum(t.nbytes for t in tensors.values())
    weight_map.update(dict.fromkeys(tensors, shard))
  with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as out:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, out, indent=1)
  with open(os.path.join(tmp, "config.json"), "w") as out:
    json.dump(config, out, indent=2)
  copied = []
  for name in TOKENIZER_FILES:
    src = os.path.join(ftw_dir, name)
    if os.path.isfile(src):
      shutil.copy2(src, os.path.join(tmp, name))
      copied.append(name)
  if not {"tokenizer.json", "tokenizer_config.json"} <= set(copied):
    print(f"ftw_to_hf: {ftw_dir} has no tokenizer.json / tokenizer_config.json; the checkpoint "
          "has no tokenizer (llama.cpp's converter needs one)")
  shutil.rmtree(hf_dir, ignore_errors=True)
  os.rename(tmp, hf_dir)
  return hf_dir


def check_round_trip(ftw_dir: str | os.PathLike, hf_dir: str | os.PathLike) -> dict:
  """Converts ``hf_dir`` back to FTW with ftjax's own converter (into a temporary directory)
  and checks it against ``ftw_dir``: equal model configs, the same dense tensor names, and
  every dense tensor and expert part bit-identical. Raises AssertionError naming the first
  mismatch; returns a summary."""
  from ftjax.formats import ftw  # noqa: PLC0415
  from ftjax.formats.hf import convert_hf  # noqa: PLC0415

  original = ftw.FTWFile.open(ftw_dir, verify=False)
  with tempfile.TemporaryDirectory(prefix="ftw_to_hf-check-") as tmp:
    back_dir = convert_hf(hf_dir, os.path.join(tmp, "ftw"), dtype=original.index["dtype"],
                          expert_dtype=original.expert_format, show_progress=False)
    back = ftw.FTWFile.open(back_dir, verify=True)
    a, b = original.config.to_dict(), back.config.to_dict()
    differ = {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
    if differ:
      raise AssertionError(f"model configs differ (original, round trip): {differ}")
    names_a, names_b = set(original.tensor_names()), set(back.tensor_names())
    if names_a != names_b:
      raise AssertionError(f"dense tensors differ: only in the original "
                           f"{sorted(names_a - names_b)[:5]}, only after the round trip "
                           f"{sorted(names_b - names_a)[:5]}")
    for name in original.tensor_names():
      x, y = original.tensor(name), back.tensor(name)
      if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
        raise AssertionError(f"tensor {name} differs after the round trip: {x.dtype}{x.shape} "
                             f"vs {y.dtype}{y.shape}")
    c = original.config
    parts = ftw.expert_parts(c)
    for layer in range(c.num_moe_layers):
      for e in range(c.num_experts):
        for part in parts:
          x, y = original.expert_part(layer, e, part), back.expert_part(layer, e, part)
          if x.tobytes() != y.tobytes():
            raise AssertionError(f"expert part (bank layer {layer}, expert {e}, {part}) "
                                 "differs after the round trip")
    return {"dense_tensors": len(names_a), "expert_parts": c.num_moe_layers * c.num_experts
            * len(parts), "mtp_layers": c.mtp_layers, "identical": True}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("ftw_dir")
  parser.add_argument("hf_dir")
  parser.add_argument("--overwrite", action="store_true")
  parser.add_argument("--check", action="store_true",
                      help="convert the export back with ftjax and compare every tensor")
  args = parser.parse_args()
  out = export_hf(args.ftw_dir, args.hf_dir, overwrite=args.overwrite)
  print(f"wrote {out}")
  if args.check:
    print(f"round trip: {check_round_trip(args.ftw_dir, out)}")


if __name__ == "__main__":
  main()
