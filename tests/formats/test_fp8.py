"""Block-scaled FP8 checkpoints (quant_method "fp8", ``ftjax.formats.fp8``): every converted
tensor equals the numpy dequantisation cast to the storage dtype, the loaded model equals
transformers on the dequantised checkpoint, and each FP8 layout ftjax does not read is refused
with a message that names it."""

import json
import os
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import ftjax
from ftjax.formats import fp8, ftw
from ftjax.formats.safetensors import SafetensorsFile
from ftjax.utils import quant

import tolerances
from conftest import fuse_experts

E4M3_MAX = 448.0
SEQ = 24

# qwen3_moe sized for 128 x 128 blocks: D = 256 is two whole blocks, q_proj's 4 x 32 = 128
# rows one, k/v_proj's 2 x 32 = 64 rows one partial block, and the experts' F = 200 a whole
# block and a partial one of 72 (rows of gate/up, columns of down).
QWEN3_FP8 = dict(vocab_size=96, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=200, intermediate_size=48, norm_topk_prob=True,
                 initializer_range=0.08, max_position_embeddings=256, tie_word_embeddings=False,
                 eos_token_id=None, bos_token_id=None, pad_token_id=None)
# Mixtral (w1/w2/w3 experts) with small non-square blocks of 16 rows x 24 columns: D = 32
# columns are a whole block and a partial one of 8.
MIXTRAL_FP8 = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2,
                   intermediate_size=16, initializer_range=0.15, max_position_embeddings=256,
                   tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
                   pad_token_id=None)
# DeepSeek-V3 as DeepSeek and Kimi ship it in FP8: latent attention (q_a/q_b, kv_a/kv_b, o:
# every projection quantised), a dense first layer, shared experts; blocks of 16 x 24 leave
# partial blocks in most of them.
DEEPSEEK_FP8 = dict(vocab_size=96, hidden_size=40, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=20, intermediate_size=36, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=24,
                    kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=4,
                    v_head_dim=6, initializer_range=0.15, max_position_embeddings=256,
                    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
                    pad_token_id=None)
# name -> (transformers prefix, config, weight_block_size, fused experts on disk)
CHECKPOINTS = {"qwen3_moe": ("Qwen3Moe", QWEN3_FP8, [128, 128], False),
               "qwen3_moe_fused": ("Qwen3Moe", QWEN3_FP8, [128, 128], True),
               "mixtral": ("Mixtral", MIXTRAL_FP8, [16, 24], False),
               "deepseek_v3": ("DeepseekV3", DEEPSEEK_FP8, [16, 24], False)}
# Quantised as the shipped checkpoints are: attention and expert projections; embeddings,
# norms, router gates and lm_head stay bf16 (their modules_to_not_convert).
_QUANTISED = re.compile(
    r".*(_proj\.weight|experts\.\d+\.w[123]\.weight|experts\.(gate_up|down)_proj)$")


def quantise(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
  """``w`` [..., out, in] -> e4m3 codes and float32 ``scale_inv`` [..., ceil(out/bm),
  ceil(in/bn)] = max|block| / 448 (1 for a zero block), as transformers' Fp8Quantize does;
  partial last blocks are scaled by their own maximum."""
  bm, bn = block
  rows, cols = w.shape[-2:]
  sr, sc = -(-rows // bm), -(-cols // bn)
  pad = [(0, 0)] * (w.ndim - 2) + [(0, sr * bm - rows), (0, sc * bn - cols)]
  tiles = np.pad(w.astype(np.float32), pad).reshape(*w.shape[:-2], sr, bm, sc, bn)
  amax = np.abs(tiles).max(axis=(-3, -1))
  scale_inv = np.where(amax > 0, amax / np.float32(E4M3_MAX), 1).astype(np.float32)
  q = np.clip(w / expand(scale_inv, block, w.shape), -E4M3_MAX, E4M3_MAX)
  return q.astype(ml_dtypes.float8_e4m3fn), scale_inv


def expand(scale_inv: np.ndarray, block, shape) -> np.ndarray:
  """scale_inv[..., i // bm, j // bn] at every [..., i, j] of ``shape``."""
  rows, cols = shape[-2:]
  return np.repeat(np.repeat(scale_inv, block[0], -2), block[1], -1)[..., :rows, :cols]


def dequantise(q: np.ndarray, scale_inv: np.ndarray, block) -> np.ndarray:
  """The reference: float32 codes times the expanded float32 scales, in float32."""
  return q.astype(np.float32) * expand(scale_inv, block, q.shape)


def test_dequantisation_is_transformers_own():
  """fp8.dequantise equals transformers' two FP8 dequantisers bit for bit: the backward pass's
  ``_dequantize_fp8_weight``, which handles partial blocks, and the load-time ``Fp8Dequantize``,
  which handles whole blocks only."""
  from transformers.integrations.finegrained_fp8 import (  # noqa: PLC0415
      Fp8Dequantize, _dequantize_fp8_weight)
  rng = np.random.default_rng(0)
  for shape, block in [((3, 200, 96), (128, 128)), ((40, 56), (16, 24)), ((256, 384), (128, 128))]:
    q, s = quantise(rng.standard_normal(shape).astype(np.float32), block)
    got = fp8.dequantise(q, s, fp8.FP8Format(*block))
    np.testing.assert_array_equal(got, dequantise(q, s, block))
    tq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
    ref = _dequantize_fp8_weight(tq, torch.from_numpy(s), list(block), torch.float32)
    np.testing.assert_array_equal(got, ref.numpy())
    if shape[-2] % block[0] == 0 and shape[-1] % block[1] == 0:
      ref = Fp8Dequantize(None)._dequantize_one(tq, torch.from_numpy(s), torch.float32)
      np.testing.assert_array_equal(got, ref.numpy())


def unfuse(tensors: dict[str, np.ndarray], f: int) -> dict[str, np.ndarray]:
  """Fused mlp.experts.gate_up_proj [E, 2F, D] / down_proj [E, D, F] -> per-expert keys."""
  out = {}
  for name, value in tensors.items():
    m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
    if m is None:
      out[name] = value
      continue
    for e, w in enumerate(value):
      if m[2] == "down_proj":
        out[f"{m[1]}.{e}.down_proj.weight"] = w
      else:
        out[f"{m[1]}.{e}.gate_proj.weight"], out[f"{m[1]}.{e}.up_proj.weight"] = w[:f], w[f:]
  return out


def _write(out_dir, tensors: dict[str, np.ndarray], hf_config: dict, *, scales_apart: bool):
  """A checkpoint: config.json and one shard, or (``scales_apart``) the weights in one shard
  and every ``*_scale_inv`` in another, so that scales are found across shards."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f)
  if not scales_apart:
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir
  groups = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
  for name, value in tensors.items():
    groups[sorted(groups)[name.endswith("_scale_inv")]][name] = value
  for fname, group in groups.items():
    save_file(group, os.path.join(out_dir, fname), metadata={"format": "pt"})
  weight_map = {n: fname for fname, group in groups.items() for n in group}
  with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return out_dir


def build_fp8_checkpoint(name: str, root, seed: int = 0):
  """A random transformers model saved as an FP8 checkpoint, and the same weights dequantised.

  Returns (fp8 dir, dequantised dir, {HF name: float32 dequantised or bf16-as-float32 value}):
  the dequantised dir is a plain float32 per-expert checkpoint that transformers loads."""
  prefix, kwargs, block, fused = CHECKPOINTS[name]
  torch.manual_seed(seed)
  config = getattr(transformers, prefix + "Config")(**kwargs)
  model = getattr(transformers, prefix + "ForCausalLM")(config).eval().to(torch.float32)
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if "norm" in pname:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
  plain = os.path.join(root, "plain")
  model.save_pretrained(plain)
  tensors = load_file(os.path.join(plain, "model.safetensors"))
  if fused:
    tensors = fuse_experts(tensors)
  stored, values = {}, {}
  for tname, w in tensors.items():
    if _QUANTISED.match(tname):
      q, s = quantise(w, block)
      stored[tname], stored[fp8.scale_name(tname)] = q, s
      values[tname] = dequantise(q, s, block)
    else:
      stored[tname] = w.astype(ml_dtypes.bfloat16)
      values[tname] = stored[tname].astype(np.float32)
  with open(os.path.join(plain, "config.json")) as f:
    hf_config = json.load(f)
  reference = _write(os.path.join(root, "dequantised"),
                     unfuse(values, config.moe_intermediate_size) if fused else values, hf_config,
                     scales_apart=False)
  hf_config["quantization_config"] = {
      "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": block, "modules_to_not_convert": ["lm_head", "mlp.gate"]}
  src = _write(os.path.join(root, "fp8"), stored, hf_config, scales_apart=not fused)
  return src, reference, values


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
  return {name: build_fp8_checkpoint(name, tmp_path_factory.mktemp(name))
          for name in CHECKPOINTS}


# HF name (after "model.layers.{l}.") -> FTW dense tensor, for the FP8 dense weights.
_DENSE = {"self_attn.q_proj.weight": "attn.w_q_had", "self_attn.k_proj.weight": "attn.w_k_gad",
          "self_attn.v_proj.weight": "attn.w_v_gad", "self_attn.o_proj.weight": "attn.w_o_dha",
          "mlp.gate.weight": "moe.w_router_ed", "block_sparse_moe.gate.weight": "moe.w_router_ed",
          "input_layernorm.weight": "attn_norm.scale",
          # latent attention, a dense layer's MLP, shared experts (deepseek_v3)
          "self_attn.q_a_proj.weight": "attn.w_qa_qd", "self_attn.q_b_proj.weight": "attn.w_qb_hcq",
          "self_attn.kv_a_proj_with_mqa.weight": "attn.w_kva_ld",
          "self_attn.kv_b_proj.weight": "attn.w_kvb_hnr", "mlp.gate_proj.weight": "mlp.w_gate_id",
          "mlp.down_proj.weight": "mlp.w_down_di",
          "mlp.shared_experts.up_proj.weight": "moe.shared.w_up_id"}
_TOP = {"model.embed_tokens.weight": "embed_vd", "lm_head.weight": "w_lm_vd",
        "model.norm.weight": "final_norm.scale"}
_EXPERT_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate",
                "w3": "up", "w2": "down"}


def _expected(values: dict[str, np.ndarray], config):
  """(FTW dense name -> value, (bank layer, expert, part) -> value) from HF names."""
  dense, experts = {}, {}
  for name, v in unfuse(values, config.moe_intermediate_size).items():
    if name in _TOP:
      dense[_TOP[name]] = v
      continue
    m = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)"
                     r"\.weight", name)
    if m:
      experts[config.bank_layer(int(m[1])), int(m[2]), _EXPERT_PART[m[3]]] = v
      continue
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m[2] in _DENSE:
      dense[f"layers.{m[1]}.{_DENSE[m[2]]}"] = v
  return dense, experts


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_converted_tensors_equal_the_numpy_dequantisation(fp8_checkpoints, tmp_path, name,
                                                          dtype, monkeypatch):
  src, _, values = fp8_checkpoints[name]
  shapes = []
  original = fp8.dequantise

  def recording(weight, scale_inv, fmt):
    shapes.append(weight.shape)
    return original(weight, scale_inv, fmt)

  monkeypatch.setattr(fp8, "dequantise", recording)
  out = ftjax.convert_hf(src, tmp_path / "m", dtype=dtype, show_progress=False)
  assert shapes and max(len(s) for s in shapes) == 2  # streamed: one matrix at a time
  f = ftw.FTWFile.open(out)
  storage = ftw.storage_dtype(dtype)
  dense, experts = _expected(values, f.config)
  query = "layers.1.attn.w_qb_hcq" if f.config.q_lora_rank else "layers.1.attn.w_q_had"
  assert {"embed_vd", "w_lm_vd", query, "layers.1.attn.w_o_dha"} <= set(dense)
  assert len(experts) == 3 * f.config.num_decoder_moe_layers * f.config.num_experts
  for where, v in dense.items():
    got = f.tensor(where)
    np.testing.assert_array_equal(got.reshape(v.shape).view(np.uint8),
                                  v.astype(storage).view(np.uint8), err_msg=where)
  for (layer, expert, part), v in experts.items():
    np.testing.assert_array_equal(f.expert_part(layer, expert, part).view(np.uint8),
                                  v.astype(storage).view(np.uint8),
                                  err_msg=f"{layer} {expert} {part}")


def test_int8_experts_quantise_the_dequantised_weights(fp8_checkpoints, tmp_path):
  src, _, values = fp8_checkpoints["qwen3_moe"]
  f = ftw.FTWFile.open(ftjax.convert_hf(src, tmp_path / "m", dtype="bfloat16",
                                        expert_dtype="int8", show_progress=False))
  _, experts = _expected(values, f.config)
  for layer, expert, part in [(0, 0, "gate"), (1, 7, "down"), (1, 3, "up")]:
    q, s = quant.quantize_rows(experts[layer, expert, part])
    np.testing.assert_array_equal(f.expert_part(layer, expert, part), q)
    np.testing.assert_array_equal(f.expert_scale(layer, expert, part), s)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_match_transformers_on_the_dequantised_checkpoint(fp8_checkpoints, tmp_path,
                                                                 name):
  src, reference, _ = fp8_checkpoints[name]
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      reference, dtype=torch.float32, attn_implementation="eager").eval()
  model = ftjax.load(ftjax.convert_hf(src, tmp_path / "m", dtype="float32", show_progress=False))
  ids = np.random.default_rng(1).integers(0, model.config.vocab_size, SEQ)
  with torch.no_grad():
    ref = hf_model(torch.tensor(ids[None])).logits[0].numpy()
  got = ftjax.Engine(model).forward_logits(ids)
  tolerances.assert_close(got, ref, tolerances.HF_PARITY, floor=1.0, what=name)


# Refused layouts: each edits the small Mixtral FP8 checkpoint.


def _variant(fp8_checkpoints, tmp_path, *, config=None, tensors=None):
  """A copy of the Mixtral FP8 checkpoint with ``config(quantization_config)`` and
  ``tensors(dict)`` applied in place."""
  src = fp8_checkpoints["mixtral"][0]
  stored = {}
  for fname in sorted(os.listdir(src)):
    if fname.endswith(".safetensors"):
      st = SafetensorsFile(os.path.join(src, fname))
      stored.update({n: np.array(st.get(n)) for n in st.keys()})
  with open(os.path.join(src, "config.json")) as fh:
    hf_config = json.load(fh)
  if config is not None:
    config(hf_config["quantization_config"])
  if tensors is not None:
    tensors(stored)
  return _write(tmp_path / "hf", stored, hf_config, scales_apart=False)


W = "model.layers.0.self_attn.o_proj.weight"


def _per_tensor(t):
  t[W + "_scale"] = np.array(t.pop(W + "_scale_inv").max(), np.float32)


def _other_block(t):
  t[W], t[W + "_scale_inv"] = quantise(t[W].astype(np.float32), (32, 32))


def _e5m2(t):
  t[W] = t[W].astype(np.float32).astype(ml_dtypes.float8_e5m2)


def _ue8m0_scales(t):
  t[W + "_scale_inv"] = t[W + "_scale_inv"].astype(ml_dtypes.float8_e8m0fnu)


def _stray_scale(t):
  t["model.embed_tokens.weight_scale_inv"] = np.ones((6, 2), np.float32)


REFUSED = {
    "fmt_e5m2": (dict(fmt="e5m2"), None, r"fmt='e5m2'.*e4m3.*FineGrainedFP8Config\(dequantize"),
    "e5m2_tensor": (None, _e5m2, r"o_proj.weight is F8_E5M2; ftjax reads FP8 weights in e4m3"),
    "static": (dict(activation_scheme="static"), None, r"activation_scheme='static'.*static"),
    "input_scale": (None, lambda t: t.update({W[:-len("weight")] + "input_scale":
                                              np.ones((), np.float32)}),
                    r"o_proj.input_scale is a static activation scale"),
    "per_tensor_scale": (None, _per_tensor, r"per-tensor or per-channel scale .*o_proj."
                                            r"weight_scale, not block scales"),
    "no_block_size": (dict(weight_block_size=None), None, r"no weight_block_size: per-tensor"),
    "other_block_size": (None, _other_block, r"o_proj.weight \[32, 32\] has scales .* \[1, 1\], "
                                             r"but .*weight_block_size \[16, 24\] gives \[2, 2\]; "
                                             r"the scales imply blocks of about 32 x 32"),
    "missing_scale": (None, lambda t: t.pop(W + "_scale_inv"),
                      r"o_proj.weight has no block scales .*o_proj.weight_scale_inv"),
    "ue8m0_config": (dict(scale_fmt="ue8m0"), None, r"scale_fmt='ue8m0'.*UE8M0"),
    "ue8m0_scales": (None, _ue8m0_scales, r"dtype F8_E8M0 \(power-of-two UE8M0 scales"),
    "fp4_experts": (dict(expert_dtype="fp4"), None, r"expert_dtype='fp4'.*FP4-packed"),
    "stray_scale": (None, _stray_scale, r"embed_tokens.weight_scale_inv scales .*embed_tokens"
                                        r".weight, which is BF16, not FP8"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_fp8_layouts_are_refused(fp8_checkpoints, tmp_path, case):
  edit_config, edit_tensors, message = REFUSED[case]
  src = _variant(fp8_checkpoints, tmp_path,
                 config=(lambda q: q.update(edit_config)) if edit_config else None,
                 tensors=edit_tensors)
  with pytest.raises(fp8.FP8Error, match=message):
    ftjax.convert_hf(src, tmp_path / "out", show_progress=False)
  assert not os.path.exists(tmp_path / "out")
  assert [p for p in os.listdir(tmp_path) if "partial" in p] == []


@pytest.mark.parametrize("method", ["compressed-tensors", "gptq", "awq", "bitsandbytes",
                                    "fbgemm_fp8"])
def test_other_quantisation_methods_are_refused(fp8_checkpoints, tmp_path, method):
  src = _variant(fp8_checkpoints, tmp_path, config=lambda q: q.update(quant_method=method))
  with pytest.raises(ValueError, match=f"quant_method='{method}'.*block-scaled FP8 "
                                       r"\(quant_method 'fp8'\)"):
    ftjax.convert_hf(src, tmp_path / "out", show_progress=False)


def test_float8_tensors_without_an_fp8_config_are_refused(fp8_checkpoints, tmp_path):
  src = _variant(fp8_checkpoints, tmp_path)
  with open(os.path.join(src, "config.json")) as fh:
    hf_config = json.load(fh)
  del hf_config["quantization_config"]
  with open(os.path.join(src, "config.json"), "w") as fh:
    json.dump(hf_config, fh)
  with pytest.raises(fp8.FP8Error, match=r"is F8_E4M3 but .*quant_method is None, not 'fp8'"):
    ftjax.convert_hf(src, tmp_path / "out", show_progress=False)


def test_cli_converts_fp8_and_names_a_refused_layout(fp8_checkpoints, tmp_path):
  src = fp8_checkpoints["mixtral"][0]
  ok = subprocess.run([sys.executable, "-m", "ftjax.convert", f"--hf_dir={src}",
                       f"--out={tmp_path / 'ok'}"], capture_output=True, text=True, check=False)
  assert ok.returncode == 0, ok.stderr
  assert "100.0%" in ok.stderr  # the progress bar counts the dequantised bytes exactly
  bad = _variant(fp8_checkpoints, tmp_path, config=lambda q: q.update(fmt="e5m2"))
  proc = subprocess.run([sys.executable, "-m", "ftjax.convert", f"--hf_dir={bad}",
                         f"--out={tmp_path / 'bad'}"], capture_output=True, text=True,
                        check=False)
  assert proc.returncode != 0
  assert "fmt='e5m2'" in proc.stderr and "Traceback" not in proc.stderr
