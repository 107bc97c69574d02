"""Shared test helpers: tiny random-initialised Hugging Face checkpoints built offline.

The suite's tolerances and its float64 MoE reference are modules next to this file
(``tolerances.py``, ``reference.py``); tests import them by name (``pythonpath`` in
pyproject.toml puts this folder on the path).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import os
import shutil
import tempfile

# CI time: the suite's programs are tiny, so compiling them is most of its time, and XLA's
# backend at optimisation level 0 compiles them 20-30% faster (the same HLO, the same IEEE
# arithmetic; only the generated code is slower, which tiny shapes do not feel). Set before
# jax starts a backend; subprocesses inherit it. An XLA_FLAGS that names the level wins.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))

# CI time: programs that recur (the same tiny model's in several modules after the per-module
# cache clearing below, the embedded models' in every CLI subprocess) are compiled once per run,
# in JAX's persistent compilation cache in a fresh folder for this run (removed at exit;
# subprocesses inherit it). A JAX_COMPILATION_CACHE_DIR of one's own is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _compile_cache = tempfile.mkdtemp(prefix="ftjax-tests-xla-cache-")
  atexit.register(shutil.rmtree, _compile_cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _compile_cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# CI time: pytest-xdist runs whole files on its 2 workers (``--dist loadfile``), handing out the
# next file to whichever worker is free. Its default order (most tests first) left the server's
# files, few tests but minutes each, for the end, where one worker ran them while the other had
# nothing left. These files start first (``--no-loadscope-reorder`` keeps this order), each
# at least ~1.5 min of CPU in a run on the 2-core AVX2 Zen 3 VM, heaviest first, so that the
# many short files even out the end. A file missing here only runs later.
SLOW_FILES_FIRST = (
    "server/test_tool_calls.py", "cache/test_engine_cache.py", "server/test_server.py",
    "server/test_agent_apis.py", "runtime/test_device_loop.py", "cache/test_gpu_program.py",
    "runtime/test_session.py", "runtime/test_engine_memory.py", "cache/test_sharded_cache.py",
    "model/test_gpt_oss_parity.py", "server/test_precompile.py", "server/test_reply_formats.py",
    "model/test_hf_parity.py", "model/test_mtp_deepseek.py")


def pytest_collection_modifyitems(items):
  tests_dir = os.path.dirname(os.path.abspath(__file__))

  def rank(item):
    relative = os.path.relpath(str(item.path), tests_dir)
    return SLOW_FILES_FIRST.index(relative) if relative in SLOW_FILES_FIRST else len(
        SLOW_FILES_FIRST)

  items.sort(key=rank)  # stable: the order within a file, and among the rest, is kept


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """After each test module, drops JAX's caches of traced and compiled programs. JAX keeps up
  to 2048 executables per cache for reuse, and XLA:CPU maps each one's code into memory: the
  whole suite in one process would pass ``vm.max_map_count`` (65530) and crash the next
  compile inside LLVM. (ftjax's own tables go with their last engine.)"""
  yield
  jax.clear_caches()
  gc.collect()


# Tiny configs, one per family. Shapes are small but every option of the family is on:
# Qwen2-MoE's gated shared expert and qkv bias, OLMoE's full-projection q/k norm and
# clipping, Mixtral's sliding window (shorter than the test sequence).
_COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, num_experts_per_tok=2, initializer_range=0.15,
               max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=None,
               bos_token_id=None, pad_token_id=None)
HF_FAMILIES = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=16, intermediate_size=48,
                      norm_topk_prob=True, rope_theta=10000.0),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=16, intermediate_size=48,
                      shared_expert_intermediate_size=24, norm_topk_prob=False, qkv_bias=True),
    "mixtral": dict(num_local_experts=8, intermediate_size=16, sliding_window=7),
    "olmoe": dict(num_experts=8, intermediate_size=16, clip_qkv=3.0, norm_topk_prob=False),
    # the sigmoid router with its selection bias, q/k norms over all heads, partial rotary
    "minimax_m2": dict(num_local_experts=8, intermediate_size=16, rotary_dim=4),
    # a dense first layer, ungated shared experts, the grouped sigmoid router (2 groups of 4,
    # the best 1 kept), scaled weights, qkv bias, per-head q/k norms, partial rotary (half)
    "glm4_moe": dict(num_hidden_layers=3, n_routed_experts=8, moe_intermediate_size=16,
                     intermediate_size=40, n_shared_experts=2, first_k_dense_replace=1, n_group=2,
                     topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True,
                     attention_bias=True),
    # multi-head latent attention (q through a rank-16 bottleneck, a 12-dim latent and a 4-dim
    # interleaved rotary key, 8 unrotated q/k dims, 6 value dims), YaRN with mscale_all_dim,
    # a dense first layer, shared experts, the grouped sigmoid router
    "deepseek_v3": dict(num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                        moe_intermediate_size=16,
                        intermediate_size=40, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=2, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=16,
                        kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=4,
                        v_head_dim=6,
                        rope_interleave=True,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=64, mscale=1.0,
                                             mscale_all_dim=1.0, beta_fast=32.0,
                                             beta_slow=1.0)),
    # GLM-4.7-Flash: DeepSeek's latent attention with q in one projection (no q rank), rotary
    # dims paired (i, i + P/2), a dense middle layer (mlp_layer_types)
    "glm4_moe_lite": dict(num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                          moe_intermediate_size=16, intermediate_size=40, n_shared_experts=1,
                          mlp_layer_types=["sparse", "dense", "sparse"], routed_scaling_factor=1.8,
                          q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=6,
                          qk_rope_head_dim=4, head_dim=4, v_head_dim=10, rope_interleave=False),
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): latent attention plus an indexer that
    # keeps index_topk earlier tokens; with index_topk (64) above every context here it keeps
    # them all, the dense latent attention ftjax runs
    "deepseek_v32": dict(num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                         moe_intermediate_size=16, intermediate_size=40, first_k_dense_replace=1,
                         n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=12,
                         qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=4, v_head_dim=6,
                         index_topk=64, index_head_dim=8, index_n_heads=2),
    "glm_moe_dsa": dict(num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                        moe_intermediate_size=16, intermediate_size=40, first_k_dense_replace=1,
                        q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
                        head_dim=4, v_head_dim=10, index_topk=64, index_head_dim=8,
                        index_n_heads=2),
}


SIGMOID_ROUTED = ("minimax_m2", "glm4_moe", "deepseek_v3", "glm4_moe_lite", "deepseek_v32",
                  "glm_moe_dsa")


def _hf_classes(family):
  import transformers  # noqa: PLC0415
  names = {"qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral",
           "olmoe": "Olmoe", "minimax_m2": "MiniMaxM2", "glm4_moe": "Glm4Moe",
           "deepseek_v3": "DeepseekV3", "glm4_moe_lite": "Glm4MoeLite",
           "deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa"}[family]
  return getattr(transformers, names + "Config"), getattr(transformers, names + "ForCausalLM")


def build_hf_model(family: str, seed: int = 0):
  """A random float32 transformers model; norms and biases get noise so none is identity."""
  import torch  # noqa: PLC0415
  torch.manual_seed(seed)
  config_cls, model_cls = _hf_classes(family)
  config = config_cls(**{**_COMMON, **HF_FAMILIES[family]})
  model = model_cls(config).eval().to(torch.float32)
  model.config._attn_implementation = "eager"
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.2 * torch.randn_like(p))
      elif name.endswith("gate.weight") and family in SIGMOID_ROUTED:
        p.copy_(0.3 * torch.randn_like(p))  # initialised to zeros (GLM)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):  # the sigmoid router's selection bias
        b.copy_(0.1 * torch.randn_like(b))
  return model


def hf_greedy(model, ids, new: int) -> list[int]:
  """transformers' greedy continuation of ``ids``: exactly ``new`` tokens."""
  import torch  # noqa: PLC0415
  with torch.no_grad():
    out = model.generate(torch.tensor(np.asarray(ids)[None]), max_new_tokens=new,
                         do_sample=False, min_new_tokens=new, pad_token_id=0)
  return out[0, len(ids):].tolist()


def _write_safetensors(tensors: dict[str, np.ndarray], out_dir: str, shards: int) -> None:
  from safetensors.numpy import save_file  # noqa: PLC0415
  for f in os.listdir(out_dir):
    if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
      os.remove(os.path.join(out_dir, f))
  names = sorted(tensors)
  if shards == 1:
    save_file({n: tensors[n] for n in names}, os.path.join(out_dir, "model.safetensors"))
    return
  weight_map = {}
  for i, chunk in enumerate(np.array_split(np.array(names, dtype=object), shards)):
    fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    save_file({n: tensors[n] for n in chunk}, os.path.join(out_dir, fname))
    weight_map.update({n: fname for n in chunk})
  with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)


def fuse_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Per-expert keys -> fused mlp.experts.gate_up_proj [E, 2F, D] and down_proj [E, D, F]."""
  import re  # noqa: PLC0415
  out, per_layer = {}, {}
  pat = re.compile(r"(model\.(?:language_model\.)?layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts"
                   r"\.(\d+)\.(\w+)\.weight")
  for name, value in tensors.items():
    m = pat.fullmatch(name)
    if m:
      part = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m[3], m[3])
      per_layer.setdefault(m[1], {}).setdefault(part, {})[int(m[2])] = value
    else:
      out[name] = value
  for prefix, parts in per_layer.items():
    n = len(parts["gate_proj"])
    gate = np.stack([parts["gate_proj"][e] for e in range(n)])
    up = np.stack([parts["up_proj"][e] for e in range(n)])
    out[f"{prefix}.mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
    out[f"{prefix}.mlp.experts.down_proj"] = np.stack([parts["down_proj"][e] for e in range(n)])
  return out


def save_hf_checkpoint(model, out_dir: str, *, fused: bool = False, shards: int = 1) -> str:
  """save_pretrained, then optionally rewrite as fused 3-D experts and/or several shards."""
  from safetensors.numpy import load_file  # noqa: PLC0415
  model.save_pretrained(out_dir)
  if fused or shards > 1:
    tensors = load_file(os.path.join(out_dir, "model.safetensors"))
    if fused:
      tensors = fuse_experts(tensors)
    _write_safetensors(tensors, out_dir, shards)
  return out_dir


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
  """family -> (torch model, checkpoint dir). Layouts differ across families so that both
  expert layouts and sharding are exercised."""
  layouts = {"qwen3_moe": dict(fused=True, shards=3), "qwen2_moe": dict(fused=True),
             "mixtral": dict(), "olmoe": dict(shards=2), "minimax_m2": dict(),
             "glm4_moe": dict(fused=True, shards=2), "deepseek_v3": dict(shards=2),
             "glm4_moe_lite": dict(fused=True), "deepseek_v32": dict(), "glm_moe_dsa": dict()}
  out = {}
  for family, layout in layouts.items():
    model = build_hf_model(family)
    path = save_hf_checkpoint(model, str(tmp_path_factory.mktemp(family)), **layout)
    out[family] = (model, path)
  return out


# Hybrid families (Gated DeltaNet + gated attention): three linear layers, then one full
# attention layer. head_dim 16 with partial_rotary_factor 0.25 rotates 4 of 16 dims; 2 key
# heads serve 4 value heads; value and key head widths differ.
HYBRID_COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=16, shared_expert_intermediate_size=24,
                     linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
                     linear_num_key_heads=2, linear_num_value_heads=4,
                     max_position_embeddings=512, initializer_range=0.15,
                     tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
                     pad_token_id=None)
# name -> (transformers classes, composite config?, layout): every on-disk layout the
# converter reads, each family in the style its checkpoints ship.
HYBRID_CHECKPOINTS = {
    "qwen3_next": ("Qwen3Next", False, dict()),  # per-expert tensors, fused in_proj_qkvz/ba
    "qwen3_5_moe": ("Qwen3_5Moe", True, dict(fused=True)),  # composite config, fused experts
    "qwen3_5_moe_text": ("Qwen3_5Moe", False, dict(fused=True, shards=2)),  # text-only config
}


def build_hybrid_model(name: str, seed: int = 0):
  """A random float32 transformers hybrid model; every norm and gate gets noise."""
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415
  prefix, composite, _ = HYBRID_CHECKPOINTS[name]
  torch.manual_seed(seed)
  text = getattr(transformers, prefix + ("TextConfig" if prefix == "Qwen3_5Moe" else "Config"))(
      **HYBRID_COMMON)
  if composite:
    config = transformers.Qwen3_5MoeConfig(
        text_config=text.to_dict(),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=32))
    model = transformers.Qwen3_5MoeForConditionalGeneration(config)
  else:
    model = getattr(transformers, prefix + "ForCausalLM")(text)
  model = model.eval().to(torch.float32)
  model.config._attn_implementation = "eager"
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if "visual" in pname:
        continue
      if "linear_attn.norm" in pname:  # the gated norm: scale w, init 1
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif "norm" in pname:  # zero-centred norms: scale 1 + w, init 0
        p.copy_(0.2 * torch.randn_like(p))
  return model


@pytest.fixture(scope="session")
def hybrid_checkpoints(tmp_path_factory):
  """name -> (torch model, checkpoint dir) for every entry of HYBRID_CHECKPOINTS."""
  out = {}
  for name, (_, _, layout) in HYBRID_CHECKPOINTS.items():
    model = build_hybrid_model(name)
    out[name] = (model, save_hf_checkpoint(model, str(tmp_path_factory.mktemp(name)), **layout))
  return out


# gpt-oss: alternating sliding (window 6, shorter than the test prompts) and full attention
# with sinks, q/k/v/o biases, YaRN rope whose ramp covers some of the 8 rotary frequencies
# (original context 64), the biased router, and biased experts with the clamped SwiGLU. The
# vocabulary covers the 256 bytes, so the decode CLI runs it with its byte-level tokenizer.
GPT_OSS = dict(vocab_size=272, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
               intermediate_size=24, sliding_window=6, max_position_embeddings=256,
               initializer_range=0.15, tie_word_embeddings=False, eos_token_id=None,
               bos_token_id=None, pad_token_id=None,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 64})
GPT_OSS_GATE_UP_STD = 0.35  # x @ gate_up has std ~2.8 (D = 64): some |g|, |u| pass limit 7


def build_gpt_oss_model(seed: int = 0, **overrides):
  """A random float32 transformers GptOssForCausalLM (eager attention and experts). Norms,
  biases and sinks get noise; the experts' gate_up projection is scaled so that the clamped
  SwiGLU's limit (7.0) is reached, and the output projection scaled down to keep the residual
  stream in range."""
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415
  torch.manual_seed(seed)
  config = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
  model = transformers.GptOssForCausalLM(config).eval().to(torch.float32)
  model.config._attn_implementation = "eager"
  model.config._experts_implementation = "eager"
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith("gate_up_proj"):
        p.copy_(GPT_OSS_GATE_UP_STD * torch.randn_like(p))
      elif name.endswith("down_proj"):
        p.copy_(0.05 * torch.randn_like(p))
      elif name.endswith("bias") or name.endswith("sinks"):
        p.copy_(0.5 * torch.randn_like(p))
  return model


@pytest.fixture(scope="session")
def gpt_oss_checkpoint(tmp_path_factory):
  """(torch model, checkpoint dir) of the tiny gpt-oss model, saved as transformers does."""
  model = build_gpt_oss_model()
  return model, save_hf_checkpoint(model, str(tmp_path_factory.mktemp("gpt_oss")))


@pytest.fixture(scope="session")
def tiny_config():
  from ftjax.model.config import ModelConfig  # noqa: PLC0415
  return ModelConfig(
      model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=8, num_experts=8, top_k=2, moe_intermediate_size=16,
      rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
      layer_types=("full_attention",) * 2, qk_norm="per_head", norm_topk_prob=True)


@pytest.fixture(scope="session")
def tiny_hybrid_config(tiny_config):
  """tiny_config as a Qwen3.5-style hybrid: a Gated DeltaNet layer, then gated attention."""
  return dataclasses.replace(
      tiny_config, model_type="qwen3_5_moe", layer_types=("linear_attention", "full_attention"),
      partial_rotary_factor=0.5, attn_output_gate=True, norm_zero_centred=True,
      shared_expert_intermediate_size=24, shared_expert_gate=True, linear_num_key_heads=2,
      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
      linear_conv_kernel=4)


def greedy_run(engine, prompts, steps: int, tokens_per_step=None):
  """Prefill ``prompts`` [B, P], then ``steps`` single-token steps of the engine's own greedy
  tokens (or ``tokens_per_step``, teacher forcing): (logits per step [steps + 1, B, V],
  tokens [steps, B])."""
  import jax.numpy as jnp  # noqa: PLC0415
  batch, prompt = np.shape(prompts)
  state = engine.new_state(batch, prompt + steps + 1)
  ids = jnp.asarray(np.array(prompts, np.int32))
  pos = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (batch, prompt))
  state, logits = engine.step(state, ids, pos, last_only=True)
  out_logits, out_tokens = [np.asarray(logits[:, -1])], []
  for i in range(steps):
    tok = (tokens_per_step[i] if tokens_per_step is not None
           else out_logits[-1].argmax(-1).astype(np.int32))
    out_tokens.append(tok)
    state, logits = engine.step(state, jnp.asarray(tok)[:, None],
                                jnp.full((batch, 1), prompt + i, jnp.int32), last_only=True)
    out_logits.append(np.asarray(logits[:, -1]))
  return np.stack(out_logits), np.stack(out_tokens)


def scaled_params(model, factor: float):
  """The model with every weight multiplied by ``factor`` (sharper routing and logits), except
  the Gated DeltaNet decay parameters, which keep their values so the recurrent state neither
  vanishes nor explodes."""

  def scale(path, x):
    return x if any(k in str(path) for k in ("a_log_m", "dt_bias_m")) else x * factor

  params = jax.tree_util.tree_map_with_path(scale, model.params)
  return dataclasses.replace(model, params=params, bank=model.bank * factor)


@pytest.fixture
def fresh_programs(monkeypatch):
  """Starts with no compiled programs (``engine.compile_count`` then counts every program a
  test's engines need) and empty JAX caches; returns a list that grows by one each time the
  model is traced."""
  from ftjax.model import transformer  # noqa: PLC0415
  from ftjax.runtime import programs  # noqa: PLC0415
  traces = []
  original = transformer.Transformer.__call__

  def counting(self, *args, **kwargs):
    traces.append(1)  # runs only while tracing
    return original(self, *args, **kwargs)

  monkeypatch.setattr(transformer.Transformer, "__call__", counting)
  programs.clear_compiled()
  jax.clear_caches()
  return traces


# gpt-oss with MXFP4 experts: the tiny config with F = 32 (MXFP4 blocks of 32 inputs along D and
# along F). E8M0 exponents put the dequantised gate_up near GPT_OSS_GATE_UP_STD (random E2M1
# codes have rms ~2.9) and down near 0.05.
GPT_OSS_MXFP4 = dict(GPT_OSS, intermediate_size=32)
MXFP4_EXPONENTS = {"gate_up_proj": (123, 125), "down_proj": (120, 122)}  # [low, high) of e


def save_gpt_oss_mxfp4_checkpoint(out_dir: str, seed: int = 0):
  """A random tiny GptOssForCausalLM whose experts are MXFP4 as gpt-oss ships them: the
  checkpoint holds uint8 ``*_blocks`` [E, out, in/32, 16] and ``*_scales`` [E, out, in/32]
  and ``quantization_config.quant_method = "mxfp4"``; the returned torch model holds the
  experts transformers' own ``convert_moe_packed_tensors`` dequantises from them (float32), the
  reference. Returns (torch model, checkpoint dir)."""
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415
  from safetensors.numpy import load_file, save_file  # noqa: PLC0415
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: PLC0415
  torch.manual_seed(seed)
  config = transformers.GptOssConfig(**GPT_OSS_MXFP4)
  model = transformers.GptOssForCausalLM(config).eval().to(torch.float32)
  model.config._attn_implementation = "eager"
  model.config._experts_implementation = "eager"
  rng = np.random.default_rng(seed)
  packed = {}
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith(("gate_up_proj", "down_proj")):
        e, d_in, d_out = p.shape  # transformers keeps them [E, in, out]
        low, high = MXFP4_EXPONENTS[name.rsplit(".", 1)[1]]
        blocks = rng.integers(0, 256, (e, d_out, d_in // 32, 16), dtype=np.uint8)
        scales = rng.integers(low, high, (e, d_out, d_in // 32), dtype=np.uint8)
        p.copy_(convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                           dtype=torch.float32))
        packed[name] = (blocks, scales)
      elif name.endswith("bias") or name.endswith("sinks"):
        p.copy_(0.5 * torch.randn_like(p))
  model.save_pretrained(out_dir)
  tensors = load_file(os.path.join(out_dir, "model.safetensors"))
  for name, (blocks, scales) in packed.items():
    del tensors[name]
    tensors[name + "_blocks"] = blocks
    tensors[name + "_scales"] = scales
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(out_dir, "config.json")) as f:
    hf_config = json.load(f)
  hf_config["quantization_config"] = {"quant_method": "mxfp4",
                                      "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                 "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"]}
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f)
  return model, out_dir


@pytest.fixture(scope="session")
def gpt_oss_mxfp4_checkpoint(tmp_path_factory):
  """(torch model with the dequantised experts, checkpoint dir with the MXFP4 ones)."""
  return save_gpt_oss_mxfp4_checkpoint(str(tmp_path_factory.mktemp("gpt_oss_mxfp4")))


def flip_bit(path, offset: int) -> None:
  """Flips the lowest bit of the byte at ``offset`` of the file ``path`` (checksum tests)."""
  with open(path, "r+b") as fh:
    fh.seek(offset)
    b = fh.read(1)
    fh.seek(offset)
    fh.write(bytes([b[0] ^ 0x01]))
