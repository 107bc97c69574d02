import dataclasses
import glob
import json
import math
import os

import pytest

from ftjax.model.config import ModelConfig, UnsupportedModelError, from_hf_config

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs")

# Shipped shape configs of models ftjax cannot run yet, and the error that says why. They
# are there for the cost model (tests/test_cost.py loads them as ModelShape).
NOT_RUNNABLE: dict[str, str] = {}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIG_DIR, "**", "*.json"),
                                               recursive=True)))
def test_every_shipped_config_loads(path):
  with open(path) as f:
    hf = json.load(f)
  if os.path.basename(path) in NOT_RUNNABLE:
    with pytest.raises(UnsupportedModelError, match=NOT_RUNNABLE[os.path.basename(path)]):
      from_hf_config(hf)
    return
  config = from_hf_config(hf)
  assert config.num_layers > 0 and config.num_experts >= config.top_k
  assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_shipped_configs_exist():
  assert len(glob.glob(os.path.join(CONFIG_DIR, "models", "*.json"))) >= 4


def _load(name):
  with open(os.path.join(CONFIG_DIR, "models", name)) as f:
    return json.load(f)


def test_hub_key_style_qwen3():
  c = from_hf_config(_load("qwen3-30b-a3b.json"))
  assert (c.num_layers, c.num_experts, c.top_k, c.hidden_size, c.moe_intermediate_size,
          c.vocab_size) == (48, 128, 8, 2048, 768, 151936)
  assert c.rope_theta == 1e6 and c.qk_norm == "per_head" and c.norm_topk_prob
  assert c.source_dtype == "bfloat16" and c.eos_token_ids == (151645,)


def test_family_options():
  mixtral = from_hf_config(_load("mixtral-8x7b.json"))
  assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 14336
  assert mixtral.qk_norm is None and not mixtral.qkv_bias
  olmoe = from_hf_config(_load("olmoe-1b-7b.json"))
  assert olmoe.qk_norm == "full" and not olmoe.norm_topk_prob
  qwen2 = from_hf_config(_load("qwen1.5-moe-a2.7b.json"))
  assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.shared_expert_gate
  assert qwen2.shared_expert_intermediate_size == 5632
  assert qwen2.layer_types == ("full_attention",) * 24  # use_sliding_window is false


def test_new_transformers_key_style_equals_hub_style():
  hub = _load("qwen3-30b-a3b.json")
  new = dict(hub)
  new["num_local_experts"] = new.pop("num_experts")
  new["rope_parameters"] = {"rope_type": "default", "rope_theta": new.pop("rope_theta")}
  new.pop("rope_scaling")
  new["dtype"] = new.pop("torch_dtype")
  assert from_hf_config(new) == from_hf_config(hub)


def test_files_written_by_transformers_parse(hf_checkpoints):
  for family, (model, path) in hf_checkpoints.items():
    c = ModelConfig.from_hf_dir(path)
    assert c.model_type == family
    assert c.num_experts == 8
    assert c.hidden_size == model.config.hidden_size


def test_unsupported_model_type_names_the_supported_ones():
  cfg = _load("qwen3-30b-a3b.json") | {"model_type": "dbrx"}
  with pytest.raises(UnsupportedModelError,
                     match="qwen3_moe, qwen2_moe, mixtral, olmoe, qwen3_next, qwen3_5_moe"):
    from_hf_config(cfg)


def test_qwen35_composite_config(capsys):
  c = from_hf_config(_load("qwen3.5-35b-a3b.json"))
  assert c.model_type == "qwen3_5_moe" and c.num_layers == 40
  assert c.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
  assert (c.num_experts, c.top_k, c.moe_intermediate_size, c.vocab_size) == (256, 8, 512, 248320)
  assert c.shared_expert_intermediate_size == 512 and c.shared_expert_gate
  assert c.rotary_dim == 64 and c.rope_theta == 1e7 and c.attn_output_gate
  assert c.norm_zero_centred and c.norm_topk_prob and c.qk_norm == "per_head"
  assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
          c.linear_value_head_dim, c.linear_conv_kernel) == (16, 32, 128, 128, 4)
  assert c.source_dtype == "bfloat16" and c.eos_token_ids == (248044,)
  err = capsys.readouterr().err
  # The vision tower is skipped (one line); the MTP head is read (ftjax.model.transformer.MTPHead).
  assert "vision tower is skipped" in err and "multi-token" not in err
  assert c.mtp_layers == 1 and c.num_moe_layers == 41
  assert c.vision_token_ids == (248056, 248057, 248053, 248054)
  text = from_hf_config(_load("qwen3.5-35b-a3b.json")["text_config"])  # the text-only style
  assert text == dataclasses.replace(c, vision_token_ids=())


def test_qwen3_next_derives_layer_types():
  text = dict(_load("qwen3.5-35b-a3b.json")["text_config"], model_type="qwen3_next")
  del text["layer_types"]
  text["num_hidden_layers"] = 8
  c = from_hf_config(text)
  assert c.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25,
                          "mrope_section": [24, 20, 20]}}, "mrope_section"),
    ({"attn_output_gate": False}, "attn_output_gate"),
    ({"linear_num_value_heads": 24, "linear_num_key_heads": 16}, "not a multiple"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel"),
])
def test_hybrid_unsupported_variants_name_the_field(change, message):
  text = _load("qwen3.5-35b-a3b.json")["text_config"] | change
  with pytest.raises(UnsupportedModelError, match=message):
    from_hf_config(text)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope type 'longrope'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_only_layers": list(range(48))}, "no MoE layer"),
    ({"num_experts_per_tok": 200}, "top_k"),
])
def test_unsupported_options_are_clear_errors(change, message):
  with pytest.raises(UnsupportedModelError, match=message):
    from_hf_config(_load("qwen3-30b-a3b.json") | change)


def test_gpt_oss_20b():
  c = from_hf_config(_load("gpt-oss-20b.json"))
  assert (c.num_layers, c.num_experts, c.top_k, c.hidden_size, c.moe_intermediate_size,
          c.head_dim, c.num_heads, c.num_kv_heads) == (24, 32, 4, 2880, 2880, 64, 64, 8)
  assert c.layer_types[:2] == ("sliding_attention", "full_attention") and c.sliding_window == 128
  assert c.attn_sinks and c.qkv_bias and c.o_bias and c.router == "topk_softmax"
  assert c.router_bias and c.expert_bias and c.expert_activation == "clamped_swiglu"
  assert (c.swiglu_alpha, c.swiglu_limit, c.rope_theta) == (1.702, 7.0, 150000.0)
  assert c.yarn.factor == 32.0 and c.yarn.original_max_position == 4096 and not c.yarn.truncate
  assert c.yarn.attention_factor == pytest.approx(0.1 * math.log(32.0) + 1.0)
  assert c.expert_block_elems == 3 * 2880 * 2880 + 3 * 2880


def test_yarn_defaults_follow_transformers():
  """No truncate key means truncate; no factor means max / original positions; no rope keys
  at all give gpt-oss transformers' default YaRN."""
  hf = _load("gpt-oss-20b.json")
  yarn = from_hf_config(hf | {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}).yarn
  assert yarn.truncate and yarn.original_max_position == hf["max_position_embeddings"]
  yarn = from_hf_config(hf | {"rope_scaling": {"rope_type": "yarn",
                                               "original_max_position_embeddings": 4096}}).yarn
  assert yarn.factor == 131072 / 4096
  bare = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
  assert from_hf_config(bare).yarn == from_hf_config(hf).yarn


def test_linear_attention_layers_are_refused_outside_the_hybrid_families():
  text = _load("qwen3.5-35b-a3b.json")["text_config"] | {"model_type": "qwen3_moe"}
  with pytest.raises(UnsupportedModelError, match="Gated DeltaNet"):
    from_hf_config(text)  # without the check this built a wrong all-attention model


def test_linear_attention_layers_need_their_shapes():
  c = from_hf_config(_load("qwen3-30b-a3b.json")).to_dict()
  c["layer_types"] = ["linear_attention", *c["layer_types"][1:]]
  with pytest.raises(UnsupportedModelError, match="linear_num_key_heads"):
    ModelConfig.from_dict(c)


def test_missing_config_json(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    ModelConfig.from_hf_dir(tmp_path)


def test_qwen_dense_layers_where_transformers_places_them():
  """Qwen-MoE's mlp_only_layers and decoder_sparse_step (layer i is MoE when it is not listed
  and (i + 1) % step == 0): dense layers of intermediate_size, the bank over the MoE ones."""
  hub = _load("qwen3-30b-a3b.json")
  c = from_hf_config(hub | {"decoder_sparse_step": 2, "mlp_only_layers": [5]})
  assert c.dense_layers == tuple(sorted({*range(0, 48, 2), 5}))
  assert c.dense_intermediate_size == hub["intermediate_size"]
  assert c.num_moe_layers == c.num_decoder_moe_layers == 23
  assert [c.bank_layer(i) for i in range(6)] == [None, 0, None, 1, None, None]
  assert c.bank_layer(7) == 2 and c.bank_layer(47) == 22
  assert from_hf_config(hub).dense_layers == ()
  with pytest.raises(UnsupportedModelError, match="dense MLP layers between MoE layers"):
    from_hf_config(_load("mixtral-8x7b.json") | {"mlp_only_layers": [0]})


def test_minimax_m2():
  """MiniMax-M2's config.json as shipped: the legacy rotary_dim, sigmoid scoring with the
  routing bias, q/k norms over all heads (its 'per_layer' qk_norm_type), FP8 weights."""
  c = from_hf_config(_load("minimax-m2.json"))
  assert (c.model_type, c.num_layers, c.num_experts, c.top_k, c.hidden_size,
          c.moe_intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
              "minimax_m2", 62, 256, 8, 3072, 1536, 48, 8, 128)
  assert c.rotary_dim == 64 and c.rope_theta == 5e6 and c.qk_norm == "full"
  assert c.router == "sigmoid_group" and c.norm_topk_prob and c.router_groups == 1
  assert c.routed_scaling_factor == 1.0 and c.shared_expert_intermediate_size == 0
  assert c.dense_layers == () and c.num_moe_layers == 62
  with pytest.raises(UnsupportedModelError, match="scoring_func"):
    from_hf_config(_load("minimax-m2.json") | {"scoring_func": "softmax"})


@pytest.mark.parametrize("name, layers, dense, experts, shared, groups, scaling, qk_norm", [
    ("glm-4.5-air.json", 46, 1, 128, 1408, 1, 1.0, None),
    ("glm-4.5.json", 92, 3, 160, 1536, 1, 2.5, "per_head"),
])
def test_glm4_moe(name, layers, dense, experts, shared, groups, scaling, qk_norm):
  """GLM-4.5-Air and GLM-4.5: the first first_k_dense_replace layers dense (intermediate_size),
  the rest MoE with ungated shared experts (n_shared_experts x moe_intermediate_size),
  DeepSeek's routing, half the head dims rotated, qkv biases."""
  c = from_hf_config(_load(name))
  assert c.model_type == "glm4_moe" and c.num_layers == layers and c.num_experts == experts
  assert c.dense_layers == tuple(range(dense)) and c.num_decoder_moe_layers == layers - dense
  assert c.mtp_layers == 1 and c.num_moe_layers == layers - dense + 1  # its MTP layer
  assert c.bank_layer(dense - 1) is None and c.bank_layer(dense) == 0
  assert c.bank_layer(layers) == layers - dense  # the MTP layer's experts after the decoder's
  assert c.shared_expert_intermediate_size == shared and not c.shared_expert_gate
  assert c.router == "sigmoid_group" and c.router_groups == groups and c.norm_topk_prob
  assert c.routed_scaling_factor == scaling and c.qk_norm == qk_norm
  assert c.qkv_bias and not c.o_bias and c.rotary_dim == c.head_dim // 2


@pytest.mark.parametrize("name, layers, dense, heads, experts, groups, scaling", [
    ("deepseek-v3.json", 61, 3, 128, 256, (8, 4), 2.5),
    ("kimi-k2.json", 61, 1, 64, 384, (1, 1), 2.827),
    ("glm-4.7-flash.json", 47, 1, 20, 64, (1, 1), 1.8),
])
def test_latent_attention_families(name, layers, dense, heads, experts, groups, scaling):
  """DeepSeek-V3, Kimi-K2 (model_type kimi_k2: DeepSeek-V3's architecture) and GLM-4.7-Flash
  (glm4_moe_lite): multi-head latent attention, a latent KV row of 512 + 64 per token and
  layer, YaRN's mscale_all_dim in the softmax scale, DeepSeek's routing."""
  hf = _load(name)
  c = from_hf_config(hf)
  assert c.model_type == {"kimi_k2": "deepseek_v3"}.get(hf["model_type"], hf["model_type"])
  assert (c.num_layers, c.num_heads, c.num_experts) == (layers, heads, experts)
  assert c.latent_attention and c.kv_lora_rank == 512 and c.head_dim == 64
  assert c.kv_cache_shape == (1, 576, 0) and c.kv_elements_per_token == 576
  assert c.dense_layers == tuple(range(dense)) and c.num_decoder_moe_layers == layers - dense
  assert (c.router_groups, c.router_topk_groups) == groups
  assert c.routed_scaling_factor == scaling and c.rope_interleave
  if name == "glm-4.7-flash.json":
    assert c.yarn is None and c.softmax_scale_factor == 1.0 and c.q_lora_rank == 768
  else:
    assert c.yarn.factor in (40.0, 32.0) and c.q_lora_rank == 1536
    assert c.softmax_scale_factor == pytest.approx((0.1 * math.log(c.yarn.factor) + 1) ** 2)
