"""The MTP head in DeepSeek's layout (GLM-4.5+, DeepSeek-V3: ``model.layers.{L}.enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm``, copies of the embedding and lm_head, and a MoE
decoder layer), converted into ftjax's ``MTPHead``: its logits against a float64 reference, and
speculative decoding with it.

transformers skips these tensors (``_keys_to_ignore_on_load_unexpected``) but implements the
decoder layer the head wraps. The reference is that: a second random model's last (MoE) layer,
whose tensors become the checkpoint's layer L, transformers' RMSNorm for the three norms and a
float64 ``eh_proj``, on the float64 model's final hidden states (as llama.cpp and vLLM feed it).
deepseek_v3 runs latent attention in the head too; glm4_moe grouped-query attention.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

import ftjax
from ftjax.experts import BankExperts
from ftjax.formats.hf import ConversionError
from ftjax.model.transformer import init_mtp_state, init_state, param_name

import conftest
import tolerances

NAMES = ["glm4_moe", "deepseek_v3"]
T = 20


def _add_mtp(name: str, hf_model, path: str) -> dict:
  """Writes MTP module 0 into the checkpoint at ``path`` (one shard): the donor's last layer
  as layer L, random norms and eh_proj, the embedding and lm_head copied. Returns the float64
  reference modules."""
  donor = conftest.build_hf_model(name, seed=7)
  donor_dir = path + "-donor"
  conftest.save_hf_checkpoint(donor, donor_dir)
  donor_tensors = load_file(os.path.join(donor_dir, "model.safetensors"))
  tensors = load_file(os.path.join(path, "model.safetensors"))
  last, mtp = hf_model.config.num_hidden_layers - 1, hf_model.config.num_hidden_layers
  d = hf_model.config.hidden_size
  gen = torch.Generator().manual_seed(3)
  norm_class = type(hf_model.model.norm)
  norms = {}
  for key in ("enorm", "hnorm", "shared_head.norm"):
    norms[key] = norm_class(d, eps=hf_model.config.rms_norm_eps)
    with torch.no_grad():
      norms[key].weight.copy_(1.0 + 0.2 * torch.randn(d, generator=gen))
    tensors[f"model.layers.{mtp}.{key}.weight"] = norms[key].weight.detach().numpy()
  eh_proj = 0.2 * torch.randn(d, 2 * d, generator=gen)
  tensors[f"model.layers.{mtp}.eh_proj.weight"] = eh_proj.numpy()
  tensors[f"model.layers.{mtp}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
  tensors[f"model.layers.{mtp}.shared_head.head.weight"] = tensors["lm_head.weight"]
  prefix = f"model.layers.{last}."
  tensors.update({f"model.layers.{mtp}." + n[len(prefix):]: v for n, v in donor_tensors.items()
                  if n.startswith(prefix)})
  save_file(tensors, os.path.join(path, "model.safetensors"))
  donor.config._experts_implementation = "eager"  # grouped_mm has no float64
  return {"norms": {k: m.double() for k, m in norms.items()}, "eh_proj": eh_proj.double(),
          "layer": donor.model.layers[last].double()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> (float64 transformers model, reference modules, loaded ftjax model, hf dir)."""
  out = {}
  for name in NAMES:
    hf_model = conftest.build_hf_model(name)
    path = conftest.save_hf_checkpoint(hf_model, str(tmp_path_factory.mktemp(name) / "hf"))
    ref = _add_mtp(name, hf_model, path)
    ftw_dir = ftjax.convert_hf(path, tmp_path_factory.mktemp(name) / "ftw", dtype="float32",
                               show_progress=False)
    hf_model.config._experts_implementation = "eager"
    out[name] = (hf_model.double(), ref, ftjax.load(ftw_dir), path)
  return out


@torch.no_grad()
def _reference(hf_model, ref, ids):
  """float64 MTP logits [T - 2, V] at positions 0 .. T - 3 (reading tokens 1 .. T - 2)."""
  ids_t = torch.tensor(ids[None])
  hidden = hf_model.model(ids_t).last_hidden_state[:, :-2]  # after the final norm
  embed = hf_model.model.embed_tokens(ids_t[:, 1:-1])
  z = torch.cat([ref["norms"]["enorm"](embed), ref["norms"]["hnorm"](hidden)], -1)
  z = z @ ref["eh_proj"].T
  t = z.shape[1]
  positions = torch.arange(t)[None]
  rotary = hf_model.model.rotary_emb(z, positions)
  mask = torch.triu(torch.full((t, t), float("-inf"), dtype=torch.float64), 1)[None, None]
  out = ref["layer"](z, position_embeddings=rotary, attention_mask=mask, position_ids=positions)
  out = out[0] if isinstance(out, tuple) else out
  return hf_model.lm_head(ref["norms"]["shared_head.norm"](out))[0].numpy()


def _ftjax_mtp(model, ids, kernels):
  """The head's logits over the same positions, the whole prompt at once."""
  module = nnx.merge(model.graphdef, model.params)
  c = model.config
  experts = BankExperts(bank=model.bank, ffn_dim=c.moe_intermediate_size, kernels=kernels)
  ids2 = jnp.asarray(ids[None], jnp.int32)
  positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
  _, experts, hidden, _, _ = module.hidden_and_logits(
      init_state(c, 1, len(ids)), ids2, positions, experts, kernels=kernels, fresh=True)
  n = len(ids) - 2
  _, _, _, logits = module.mtp_step(init_mtp_state(c, 1, n), jnp.zeros((), jnp.int32),
                                    hidden[:, :n], ids2[:, 1:n + 1], positions[:, :n], experts,
                                    kernels=kernels, fresh=True)
  return np.asarray(logits[0])


def test_converted_config_has_the_mtp_layer(checkpoints):
  for name in NAMES:
    model = checkpoints[name][2]
    c = model.config
    assert c.mtp_layers == 1 and c.dense_layers == (0,)
    assert model.bank.shape[0] == c.num_decoder_moe_layers + 1 == 3  # the head's experts last
    names = {param_name(p) for p, _ in nnx.to_flat_state(model.params)}
    assert {"mtp.w_fc_dx", "mtp.embed_norm.scale", "mtp.hidden_norm.scale",
            "mtp.final_norm.scale", "mtp.layers.0.attn.w_o_dha",
            "mtp.layers.0.moe.b_router_e", "mtp.layers.0.moe.shared.w_up_id"} <= names


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_mtp_logits_match_the_float64_reference(checkpoints, name, kernels):
  hf_model, ref, model, _ = checkpoints[name]
  ids = np.random.default_rng(5).integers(0, model.config.vocab_size, T)
  tolerances.assert_close(_ftjax_mtp(model, ids, kernels), _reference(hf_model, ref, ids),
                          tolerances.HF_PARITY, floor=1.0, what=f"{name} {kernels}")


@pytest.mark.parametrize("name", NAMES)
def test_speculative_greedy_equals_plain_greedy(checkpoints, name):
  model = checkpoints[name][2]
  engine = ftjax.Engine(model, kernels="ffi")
  ids = np.random.default_rng(8).integers(0, model.config.vocab_size, 11).tolist()
  want = engine.generate(ids, 12)
  for draft in (1, 3):
    assert engine.generate_speculative(ids, 12, draft_tokens=draft).tokens == want, draft


def test_a_head_with_its_own_lm_head_is_refused(checkpoints, tmp_path):
  """An MTP module whose shared_head.head is not the model's lm_head cannot run on ftjax's head
  (which reads the model's): a clear error, not a silently different head."""
  _, _, _, path = checkpoints["glm4_moe"]
  broken = tmp_path / "hf"
  broken.mkdir()
  for f in os.listdir(path):
    if not f.endswith(".safetensors"):
      with open(os.path.join(path, f), "rb") as src, open(broken / f, "wb") as dst:
        dst.write(src.read())
  tensors = load_file(os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "config.json")) as f:
    layers = json.load(f)["num_hidden_layers"]
  tensors[f"model.layers.{layers}.shared_head.head.weight"] = (
      tensors["lm_head.weight"] + 1.0).astype(np.float32)
  save_file(tensors, str(broken / "model.safetensors"))
  with pytest.raises(ConversionError, match="not a copy of lm_head.weight"):
    ftjax.convert_hf(broken, tmp_path / "ftw", dtype="float32", show_progress=False)
