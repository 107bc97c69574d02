"""A machine's cost-model hardware profile (``ftjax.research.cost.HardwareProfile``) from a
measured bandwidth profile (``ftjax.runtime.profile.measure``), with fixed overheads
calibrated from a short decode: what ``python -m ftjax.profile --hardware_out`` writes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from ftjax.model.config import ModelConfig
from ftjax.research import cost
from ftjax.runtime.engine import Engine
from ftjax.runtime.model import quantize_experts, random_model
from ftjax.runtime.profile import ExpertShape


def _memory_gb() -> float:
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def hardware_profile(measured: dict[str, Any], name: str, *, layer_overhead_s: float = 0.0,
                     step_overhead_s: float = 0.0, source: str = ""):
  """This machine as a cost-model ``HardwareProfile`` from a ``measure`` result.

  On the CPU backend the "device" is host memory: B_P is the measured slot fill (a memcpy),
  B_H the host expert kernel, both measured alone, and device_bw the read ceiling, which is
  the rate at which slot experts and dense weights are read; device memory is the RAM.
  """
  if measured["platform"] != "cpu":
    raise ValueError(f"hardware profiles are measured on the CPU backend only so far, not "
                     f"{measured['platform']!r}: write the YAML by hand from the device's numbers")
  where = (f"measured by ftjax.profile on {measured['host']} ({measured['cpu']}), "
           f"{measured['date']}, CPU backend: b_p = slot fill, b_h = host expert kernel, "
           f"device_bw = read ceiling, medians of {len(measured['rounds'])} rounds")
  return cost.HardwareProfile(
      name=name, b_p=measured["b_p_gb_s"], b_h=measured["b_h_gb_s"],
      device_bw=measured["read_gb_s"], layer_overhead_s=layer_overhead_s,
      step_overhead_s=step_overhead_s, device_memory_gb=_memory_gb(),
      source=f"{where}; {source}" if source else where,
      paths_overlap=False)  # one set of cores runs the slots and the host kernel


def calibration_model(shape: ExpertShape, num_layers: int = 2, seed: int = 0):
  """A small random model with ``shape``'s experts, to calibrate overheads without a real
  one: ``num_layers`` layers of max(4·top_k, 16) experts, vocabulary 1024, heads of 64. int8
  and mxfp4 experts: a bfloat16 model whose experts are then quantised (with gpt-oss's expert
  biases and clamped SwiGLU where ``shape.has_bias``: mxfp4 by default)."""
  quantised = shape.dtype in ("int8", "mxfp4")
  dense = "bfloat16" if quantised else shape.dtype
  gpt_oss_experts = dict(expert_activation="clamped_swiglu", expert_bias=True) if (
      shape.has_bias) else {}
  head_dim = min(64, shape.hidden)
  heads = max(1, shape.hidden // head_dim)
  config = ModelConfig(
      model_type="qwen3_moe", vocab_size=1024, hidden_size=shape.hidden, num_layers=num_layers,
      num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
      num_experts=max(4 * shape.top_k, 16), top_k=shape.top_k, moe_intermediate_size=shape.ffn,
      rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
      layer_types=("full_attention",) * num_layers, qk_norm="per_head", norm_topk_prob=True,
      source_dtype=dense, **gpt_oss_experts)
  model = random_model(config, seed=seed, dtype=dense)
  return quantize_experts(model, shape.dtype) if quantised else model


def decode_counts(engine, prompt: list[int], tokens: int) -> dict[str, Any]:
  """Decodes ``tokens`` tokens after ``prompt`` (greedy) on an engine with an expert cache;
  returns the decode steps' counts [steps, L] (hits, fills, host), the time of each step
  (``forward_s``: the decode loop runs ``decode_chunk`` steps to a program, so this is the
  chunk's time over its steps: forward and on-device sampling) and the wall time per decoded
  token (``token_s``: those plus the host's reads between chunks)."""
  engine.generate(prompt[:4], 2)  # compiles the prefill and decode steps
  before = len(engine.stats()["per_step"])
  result = engine.generate_timed(prompt, tokens + 1, greedy=True)
  steps = engine.stats()["per_step"][before + 1:]  # this request's decode steps
  if not steps:
    raise ValueError("no decode step was recorded: give tokens >= 1")
  layers = engine.model.config.num_layers  # the decoder's (an MTP head's layers never run here)
  out = {k: np.stack([s[k] for s in steps])[:, :layers].astype(np.int64)
         for k in ("hits", "fills", "host")}
  out["forward_s"] = np.array([s["seconds"] for s in steps])
  out["token_s"] = result.decode_s / len(steps)
  return out


def measure_overheads(model, hw, *, tokens: int = 8, seed: int = 0,
                      kernels: str = "auto") -> dict[str, float]:
  """Calibrates the cost model's fixed costs on ``model`` from one setting, cpu_only decode.

  Every routed expert then runs on the host kernel (no slot, no fill). With ``hw``'s
  bandwidths and the model's bytes (``ModelShape.from_config``), the modeled time of the
  bytes alone (``step_times`` with zero overheads) is subtracted from the measured forward
  time of each step; the mean remainder over the L layers is ``layer_overhead_s``. The wall
  time per token outside the forward (sampling, the host loop) is ``step_overhead_s``.
  Negative remainders (bytes modeled slower than measured) become 0, and are reported as
  ``raw_layer_overhead_s`` / ``raw_step_overhead_s``. ``kernels`` is the engine option.
  """
  c = model.config
  engine = Engine(model, kernels=kernels, cache_slots=0, policy="cpu_only",
                  max_seq_len=64 + tokens)
  prompt = np.random.default_rng(seed).integers(0, c.vocab_size, 16).tolist()
  run = decode_counts(engine, prompt, tokens)
  shape = cost.ModelShape.from_config(c, bytes_per_param=model.dtype.itemsize,
                                      expert_format=model.expert_format)
  bare = dataclasses.replace(hw, layer_overhead_s=0.0, step_overhead_s=0.0)
  modeled = cost.step_times(bare, shape, run["hits"], run["fills"], run["host"])
  layer = float(np.mean(run["forward_s"] - modeled)) / c.num_layers
  step = run["token_s"] - float(np.mean(run["forward_s"]))
  return {"layer_overhead_s": max(layer, 0.0), "step_overhead_s": max(step, 0.0),
          "raw_layer_overhead_s": layer, "raw_step_overhead_s": step,
          "steps": len(run["forward_s"]), "modeled_bytes_s": float(np.mean(modeled)),
          "measured_forward_s": float(np.mean(run["forward_s"])), "token_s": run["token_s"]}
