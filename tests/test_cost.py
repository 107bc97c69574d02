"""The decode cost model (ftjax.research.cost): hand-worked arithmetic, shapes of real models
checked against parameter counts, hardware profile files and their errors."""

import dataclasses
import glob
import json
import os

import numpy as np
import pytest

from ftjax.model import abstract_params
from ftjax.model.config import from_hf_config
from ftjax.cache.policy import fill_count
from ftjax.research import cost
from ftjax.research.cost import HardwareProfile, ModelShape

import tolerances

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
HARDWARE_FILES = sorted(glob.glob(os.path.join(CONFIGS, "hardware", "*.yaml")))
MODEL_FILES = sorted(glob.glob(os.path.join(CONFIGS, "models", "*.json")))

# Round numbers so that every case below can be worked by hand (1 GB = 1e9 bytes).
HW = HardwareProfile(name="hand", b_p=10.0, b_h=20.0, device_bw=100.0, layer_overhead_s=1e-3,
                     step_overhead_s=2e-3, device_memory_gb=16.0, source="test")
# expert_bytes = 3 · 1000 · 500 · 2 = 3e6 bytes (3 MB).
SHAPE = ModelShape(name="hand", num_layers=2, num_experts=8, top_k=2, hidden=1000,
                   expert_ffn=500, bytes_per_param=2, dense_bytes_per_layer=50e6, head_bytes=100e6)


# -- Arithmetic -------------------------------------------------------------------------------


def test_expert_bytes_and_total_experts():
  assert SHAPE.expert_bytes == 3_000_000
  assert SHAPE.total_experts == 16


def test_layer_step_device_path_slower():
  # dma: 1 fill · 3e6 / 10e9 = 0.3 ms; device: max(compute (2 hits + 1 fill) · 3e6 / 100e9
  #   = 0.09 ms, 0.3 ms + the landed fill's compute 0.03 ms) = 0.33 ms;
  # host: 1 · 3e6 bytes at B_res = 20 - 10 = 10 GB/s while the DMA runs = 0.3 ms; max = 0.33 ms.
  # + dense 50e6 / 100e9 = 0.5 ms + overhead 1 ms = 1.83 ms.
  t = cost.layer_step_time(HW, SHAPE, 2, 1, 1)
  np.testing.assert_allclose(t, 1.83e-3, rtol=tolerances.F64)


def test_layer_step_host_path_slower():
  # device: 1 hit · 3e6 / 100e9 = 0.03 ms; host (no DMA): 4 · 3e6 / 20e9 = 0.6 ms; max = 0.6 ms.
  # + 0.5 ms dense + 1 ms overhead = 2.1 ms.
  t = cost.layer_step_time(HW, SHAPE, 1, 0, 4)
  np.testing.assert_allclose(t, 2.1e-3, rtol=tolerances.F64)


def test_host_reads_at_b_res_while_the_dma_runs_and_at_b_h_after():
  # 2 fills, 4 host runs: the DMA takes 0.6 ms, during which the host reads 0.6 ms · 10 GB/s
  # = 6e6 of its 12e6 bytes; the other 6e6 at 20 GB/s take 0.3 ms: host 0.9 ms. Device:
  # 0.6 + 0.03 = 0.63 ms. Layer-step 0.9 + 1.5 = 2.4 ms, exactly all 6 misses on the host
  # (18e6 / 20e9 = 0.9 ms): q* = 6 · 10/20 = 3, and fills up to q* are free.
  both = cost.layer_step_time(HW, SHAPE, 0, 2, 4)
  np.testing.assert_allclose(both, 2.4e-3, rtol=tolerances.F64)
  np.testing.assert_allclose(cost.layer_step_time(HW, SHAPE, 0, 0, 6), both, rtol=tolerances.F64)
  # q = q* = 3: dma 0.9 ms, the host's 9e6 bytes at B_res take 0.9 ms, the device 0.93 ms:
  # the last fill's compute (0.03 ms) shows. q = 4: dma 1.2 ms (host 0.6 ms at B_res), device
  # 1.23 ms: each fill past q* costs S / B_P = 0.3 ms.
  np.testing.assert_allclose(cost.layer_step_time(HW, SHAPE, 0, 3, 3), 2.43e-3,
                             rtol=tolerances.F64)
  np.testing.assert_allclose(cost.layer_step_time(HW, SHAPE, 0, 4, 2), 2.73e-3,
                             rtol=tolerances.F64)
  # Hit compute hides under the copies: 8 hits (0.24 ms) + 2 fills (0.06 ms) = 0.3 ms of
  # compute < 0.63 ms of device path.
  np.testing.assert_allclose(cost.layer_step_time(HW, SHAPE, 8, 2, 4), both, rtol=tolerances.F64)


def test_paper_example_q_star_rounded_up():
  # DESIGN section 2: m = 3, B_P = 4, B_H = 8, S = 1 GB, q* = 1.5 -> 2: fill time 0.5 s, CPU
  # time 0.25 s at B_res = 4; q = 1 balances at 3 · 1/8 = 0.375 s (1 GB at B_res during the
  # 0.25 s DMA, 1 GB at B_H after it). Device compute, dense and overheads made negligible.
  hw = HardwareProfile(name="paper", b_p=4.0, b_h=8.0, device_bw=1e12, layer_overhead_s=0.0,
                       step_overhead_s=0.0, device_memory_gb=1.0, source="test")
  gb = ModelShape(name="1GB", num_layers=1, num_experts=8, top_k=3, hidden=1000,
                  expert_ffn=166_667, bytes_per_param=2, dense_bytes_per_layer=0.0,
                  head_bytes=0.0)
  s = gb.expert_bytes / 1e9  # 1.000002 GB; times scale with it
  np.testing.assert_allclose(cost.layer_step_time(hw, gb, 0, 2, 1), 0.5 * s, rtol=1e-9)
  np.testing.assert_allclose(cost.layer_step_time(hw, gb, 0, 1, 2), 0.375 * s, rtol=1e-9)
  np.testing.assert_allclose(cost.layer_step_time(hw, gb, 0, 0, 3), 0.375 * s, rtol=1e-9)


def test_b_p_at_least_b_h_leaves_the_host_nothing_during_the_dma():
  # B_P = B_H = 20: B_res = 0, so 1 host run waits for the 2 fills' 0.3 ms DMA and then reads
  # at 20 GB/s (0.15 ms): host 0.45 ms; device 0.3 + 0.03 = 0.33 ms.
  hw = dataclasses.replace(HW, b_p=20.0)
  np.testing.assert_allclose(cost.layer_step_time(hw, SHAPE, 0, 2, 1), 0.45e-3 + 1.5e-3,
                             rtol=tolerances.F64)
  np.testing.assert_allclose(cost.layer_step_time(hw, SHAPE, 0, 2, 0), 0.33e-3 + 1.5e-3,
                             rtol=tolerances.F64)


@pytest.mark.parametrize("path", HARDWARE_FILES, ids=os.path.basename)
def test_q_star_minimises_the_layer_step(path):
  """The q* rule's fill count against every integer q for m = 1..16 misses (and 0..8 hits).

  Under the contention model every q <= q* = m·B_P/B_H costs the all-host time m·S/B_H, and
  every q > q* costs q·S/B_P. Two exceptions, both bounded here: ``fill_count`` rounds q* up
  when that balances the two paths better (the paper's 1.5 -> 2, a fill also warms the
  cache), which costs (ceil(q*) − q*)·S/B_P in this step; and the filled expert that lands
  last is computed after its copy, S/device_bw, so when q* is that close to an integer one
  fill fewer is better by at most S/device_bw. Otherwise q* is exactly optimal; that is the
  case for most (m, profile) pairs, which the last assertion counts."""
  hw = HardwareProfile.load(path)
  shape = ModelShape.load(os.path.join(CONFIGS, "models", "qwen3-30b-a3b.json"))
  s = shape.expert_bytes / 1e9
  exact = 0
  for m in range(1, 17):
    q_fill = int(fill_count(m, hw.b_p, hw.b_h))
    q_star = m * hw.b_p / hw.b_h
    qs = np.arange(m + 1)
    for hits in (0, 4, 8):
      times = cost.layer_step_time(hw, shape, np.full(m + 1, hits), qs, m - qs)
      best = times.min()
      rounding = max(0.0, q_fill - q_star) * s / hw.b_p
      landed = s / hw.device_bw
      assert times[q_fill] - best <= rounding + landed + 1e-12, (m, hits, q_fill, times)
      # Fills past ceil(q*) are strictly worse than q*: each costs S / B_P.
      assert (times[int(np.ceil(q_star)) + 1:] > times[q_fill]).all()
      # q = 0 (never fill) is never better than q* by more than the same bound.
      assert times[q_fill] - times[0] <= rounding + landed + 1e-12
      exact += bool(np.isclose(times[q_fill], best, rtol=1e-12, atol=0))
  # q* is exactly the minimum unless it was rounded up (or sits within B_P/device_bw below
  # an integer): at least the pairs where fill_count took the floor.
  floors = sum(int(fill_count(m, hw.b_p, hw.b_h)) <= m * hw.b_p / hw.b_h - hw.b_p / hw.device_bw
               for m in range(1, 17))
  assert exact >= 3 * floors


def test_layer_step_without_overlap_adds_the_paths():
  # The case of test_layer_step_device_path_slower on a CPU-only profile: nothing overlaps,
  # so nothing contends: 0.3 ms DMA + 0.09 ms compute + 0.15 ms host at B_H = 0.54 ms,
  # + 1.5 ms = 2.04 ms.
  serial = dataclasses.replace(HW, paths_overlap=False)
  np.testing.assert_allclose(cost.layer_step_time(serial, SHAPE, 2, 1, 1), 2.04e-3,
                             rtol=tolerances.F64)
  with pytest.raises(ValueError, match="paths_overlap"):
    dataclasses.replace(HW, paths_overlap="no")


def test_layer_step_with_nothing_routed_is_dense_plus_overhead():
  np.testing.assert_allclose(cost.layer_step_time(HW, SHAPE, 0, 0, 0), 1.5e-3, rtol=tolerances.F64)


def test_step_times_and_tok_s():
  # step 0: layers (2 hits, 1 fill, 1 host) = 1.83 ms and (0, 0, 4) = 2.1 ms;
  # step 1: both layers 8 hits: 8 · 3e6 / 100e9 = 0.24 ms + 1.5 ms = 1.74 ms each.
  # + head 100e6 / 100e9 = 1 ms + step overhead 2 ms:
  # step 0 = 3.93 + 3 = 6.93 ms, step 1 = 3.48 + 3 = 6.48 ms; tok/s = 1 / 6.705 ms.
  hits = np.array([[2, 0], [8, 8]])
  fills = np.array([[1, 0], [0, 0]])
  host = np.array([[1, 4], [0, 0]])
  np.testing.assert_allclose(cost.step_times(HW, SHAPE, hits, fills, host), [6.93e-3, 6.48e-3],
                             rtol=tolerances.F64)
  assert cost.modeled_tok_s(HW, SHAPE, hits, fills, host) == pytest.approx(1 / 6.705e-3,
                                                                            rel=tolerances.F64)


def test_vectorised_equals_scalar_calls():
  rng = np.random.default_rng(0)
  hits, fills, host = (rng.integers(0, 9, (5, 7, 2)) for _ in range(3))
  got = cost.layer_step_time(HW, SHAPE, hits, fills, host)
  assert got.shape == (5, 7, 2)
  for idx in np.ndindex(got.shape):
    assert got[idx] == cost.layer_step_time(HW, SHAPE, hits[idx], fills[idx], host[idx])
  steps = cost.step_times(HW, SHAPE, hits, fills, host)
  assert steps.shape == (5, 7)
  np.testing.assert_allclose(steps, got.sum(-1) + 1e-3 + 2e-3, rtol=tolerances.F64)


def test_count_shapes_and_layer_axis_are_checked():
  with pytest.raises(ValueError, match="equal shapes"):
    cost.layer_step_time(HW, SHAPE, np.zeros((3, 2)), np.zeros((3, 2)), np.zeros((2, 3)))
  with pytest.raises(ValueError, match="layer axis of 2 layers"):
    cost.step_times(HW, SHAPE, *(np.zeros((3, 4)),) * 3)
  with pytest.raises(ValueError, match=">= 0"):
    cost.layer_step_time(HW, SHAPE, -1, 0, 0)
  deeper = dataclasses.replace(SHAPE, num_layers=4)  # the fix the error suggests
  assert cost.step_times(HW, deeper, *(np.zeros((3, 4)),) * 3).shape == (3,)


# -- Hardware profiles ------------------------------------------------------------------------

# The paper's Table 1 (DESIGN section 2): measured B_P, B_H in GB/s.
PAPER_TABLE_1 = {
    "rtx5090-server.yaml": (52.7, 77.3), "rtx4090.yaml": (25.1, 63.2),
    "rtx3090.yaml": (25.3, 56.7), "rtx5090-desktop.yaml": (49.0, 53.8),
    "rtx4060-laptop.yaml": (11.8, 47.5), "rtx-pro-6000.yaml": (51.5, 178.0),
}


@pytest.mark.parametrize("path", HARDWARE_FILES, ids=os.path.basename)
def test_every_hardware_file_loads(path):
  hw = HardwareProfile.load(path)
  assert hw.name == os.path.splitext(os.path.basename(path))[0]
  assert hw.b_p > 0 and hw.b_h > 0 and hw.device_bw > hw.b_h and hw.source


def test_hardware_files_hold_the_paper_systems_and_an_h200():
  names = {os.path.basename(p) for p in HARDWARE_FILES}
  assert set(PAPER_TABLE_1) | {"h200-host.yaml"} <= names
  for name, (b_p, b_h) in PAPER_TABLE_1.items():
    hw = HardwareProfile.load(os.path.join(CONFIGS, "hardware", name))
    assert (hw.b_p, hw.b_h) == (b_p, b_h), name
  h200 = HardwareProfile.load(os.path.join(CONFIGS, "hardware", "h200-host.yaml"))
  assert (h200.device_bw, h200.device_memory_gb) == (4800.0, 141.0)
  assert "assumed" in h200.source


def test_yaml_round_trip(tmp_path):
  path = HW.save(tmp_path / "hw.yaml")
  assert HardwareProfile.load(path) == HW
  assert HW.to_dict()["b_p"] == 10.0 and list(HW.to_dict()) == list(HardwareProfile.keys())


@pytest.mark.parametrize("change, message", [
    ({"b_p": None}, r"missing key\(s\) \['b_p'\]: add them"),
    ({"bandwidth": 3.0}, r"unknown key\(s\) \['bandwidth'\]: remove them"),
    ({"b_h": 0}, "'b_h' must be positive, got 0: fix the value"),
    ({"device_bw": -5.0}, "'device_bw' must be positive"),
    ({"layer_overhead_s": -1e-6}, "'layer_overhead_s' must be >= 0"),
    ({"b_p": "fast"}, "'b_p' must be a number, got 'fast'"),
    ({"b_p": True}, "'b_p' must be a number"),
    ({"name": ""}, "'name' must be a non-empty string"),
])
def test_yaml_errors_name_file_key_and_fix(tmp_path, change, message):
  import yaml
  d = HW.to_dict() | change
  d = {k: v for k, v in d.items() if v is not None}
  path = tmp_path / "bad.yaml"
  path.write_text(yaml.safe_dump(d))
  with pytest.raises(ValueError, match=message) as e:
    HardwareProfile.load(path)
  assert str(path) in str(e.value)


def test_yaml_file_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="ftjax.profile --hardware_out"):
    HardwareProfile.load(tmp_path / "missing.yaml")
  (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
  with pytest.raises(ValueError, match="expected a mapping"):
    HardwareProfile.load(tmp_path / "list.yaml")
  (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
  with pytest.raises(ValueError, match="not valid YAML"):
    HardwareProfile.load(tmp_path / "broken.yaml")


# -- Model shapes ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", MODEL_FILES, ids=os.path.basename)
def test_every_model_file_loads(path):
  shape = ModelShape.load(path)
  assert shape.name == os.path.splitext(os.path.basename(path))[0]
  assert shape.bytes_per_param == 2  # all shipped checkpoints are bfloat16
  assert shape.dense_bytes_per_layer > 0 and shape.head_bytes > 0
  bias = 2 * shape.expert_ffn + shape.hidden if shape.expert_bias else 0
  assert shape.expert_bytes == (3 * shape.hidden * shape.expert_ffn + bias) * 2


def _total_params(shape: ModelShape, vocab: int) -> float:
  """All weights: L · (dense + E experts) + the embedding (head_bytes counts one row)."""
  per_layer = shape.dense_bytes_per_layer + shape.num_experts * shape.expert_bytes
  return (shape.num_layers * per_layer + shape.head_bytes + (vocab - 1) * shape.hidden
          * shape.bytes_per_param) / shape.bytes_per_param


def test_qwen3_30b_a3b_matches_its_published_size():
  # attention: 2048·(32·128 + 2·4·128) + 32·128·2048 + q/k norms 2·128 = 18,874,624;
  # router 128·2048 + two norms 2·2048 = 266,240 -> 19,140,864 params = 38,281,728 bytes.
  # head: (2048 + 2048 + 151936·2048) · 2 = 622,338,048 bytes.
  s = ModelShape.load(os.path.join(CONFIGS, "models", "qwen3-30b-a3b.json"))
  assert (s.num_layers, s.num_experts, s.top_k, s.hidden, s.expert_ffn) == (48, 128, 8, 2048, 768)
  assert s.dense_bytes_per_layer == 38_281_728 and s.head_bytes == 622_338_048
  assert _total_params(s, 151936) == pytest.approx(30.5e9, rel=0.01)  # model card: 30.5B


def test_gpt_oss_20b_matches_its_published_size():
  # attention: 2880·(4096 + 2·512) + 4096·2880 + q/k/v biases 5120 + o bias 2880 + 64 sinks
  #   = 26,550,144; router 32·2880 + its bias 32 + two norms 2·2880 = 97,952
  #   -> 26,648,096 params = 53,296,192 bytes.
  # expert: 3·2880·2880 + gate, up and down biases 3·2880 = 24,891,840 params.
  s = ModelShape.load(os.path.join(CONFIGS, "models", "gpt-oss-20b.json"))
  assert (s.num_layers, s.num_experts, s.top_k, s.hidden, s.expert_ffn) == (24, 32, 4, 2880, 2880)
  assert s.expert_bias and s.expert_bytes == 24_891_840 * 2
  assert s.dense_bytes_per_layer == 53_296_192
  assert _total_params(s, 201088) == pytest.approx(20.91e9, rel=0.001)  # model card: 20.91B


def test_qwen35_35b_a3b_hybrid_shape():
  # Gated DeltaNet (key_dim 2048, value_dim 4096, conv_dim 8192, Hv 32):
  #   2048·(8192 + 4096 + 64) + 8192·4 + 4096·2048 + 2·32 + 128 = 33,718,464 params;
  # gated attention: 2048·(16·256·2 + 2·2·256) + 16·256·2048 + 2·256 = 27,263,488;
  # mean mixer over 30 + 10 layers: (30·33,718,464 + 10·27,263,488) / 40 = 32,104,720;
  # router 256·2048 + norms 2·2048 + shared expert 3·2048·512 + its gate 2048 = 3,676,160;
  # dense = 35,780,880 params = 71,561,760 bytes; head (2048 + 2048 + 248320·2048)·2.
  s = ModelShape.load(os.path.join(CONFIGS, "models", "qwen3.5-35b-a3b.json"))
  assert (s.num_layers, s.num_experts, s.top_k, s.hidden, s.expert_ffn) == (40, 256, 8, 2048, 512)
  assert s.expert_bytes == 6_291_456
  assert s.dense_bytes_per_layer == 71_561_760
  assert s.head_bytes == (2048 + 2048 + 248320 * 2048) * 2
  assert 34e9 < _total_params(s, 248320) < 35e9  # "35B" includes the vision tower and MTP


def test_hybrid_layer_types_default_from_the_interval():
  path = os.path.join(CONFIGS, "models", "qwen3.5-35b-a3b.json")
  with open(path) as f:
    text = json.load(f)["text_config"]
  del text["layer_types"]  # transformers derives them from full_attention_interval
  assert ModelShape.from_hf_config(text, name="qwen3.5-35b-a3b") == ModelShape.load(path)
  all_linear = text | {"full_attention_interval": 1000}
  assert (ModelShape.from_hf_config(all_linear).dense_bytes_per_layer
          == (33_718_464 + 3_676_160) * 2)


def test_hybrid_matches_transformers_parameter_count():
  """The formulas against a tiny random Qwen3.5-MoE text model built by transformers."""
  import torch
  import transformers
  config = transformers.Qwen3_5MoeTextConfig(
      vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
      linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=3,
      moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6,
      num_experts_per_tok=2, full_attention_interval=2)
  torch.manual_seed(0)
  model = transformers.Qwen3_5MoeForCausalLM(config)
  want = sum(p.numel() for p in model.parameters())
  shape = ModelShape.from_hf_config(config.to_dict(), bytes_per_param=4)
  assert _total_params(shape, 96) == want


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b.json", "qwen3-30b-a3b.json"])
def test_model_shape_equals_the_real_layer_bytes(name, tiny_hybrid_config):
  """dense_bytes_per_layer and head_bytes against the parameters ftjax's model actually has
  (abstract shapes: nothing allocated), layer by layer, hybrid and attention-only."""
  configs = [tiny_hybrid_config]
  with open(os.path.join(CONFIGS, "models", name)) as f:
    configs.append(from_hf_config(json.load(f)))
  for config in configs:
    shape = ModelShape.from_config(config, bytes_per_param=2)
    params = abstract_params(config)
    per_layer = [sum(np.prod(v.shape) for k, v in params.items()
                     if k.startswith(f"layers.{i}.")) for i in range(config.num_layers)]
    assert shape.dense_bytes_per_layer == pytest.approx(2 * np.mean(per_layer), rel=1e-12)
    # A plain step: the MTP head (mtp.*, qwen3.5's config names one) does not run.
    head = sum(np.prod(v.shape) for k, v in params.items()
               if not k.startswith(("layers.", "mtp.")))
    # head_bytes counts one embedding row and the lm_head; the model stores both tables.
    lm = config.vocab_size * config.hidden_size
    tied = lm if config.tie_word_embeddings else 0
    assert shape.head_bytes == 2 * (head - lm + tied + config.hidden_size)


def test_attention_families_match_transformers_parameter_counts(hf_checkpoints,
                                                                gpt_oss_checkpoint):
  for family, (model, path) in hf_checkpoints.items() | {"gpt_oss": gpt_oss_checkpoint}.items():
    shape = ModelShape.load(os.path.join(path, "config.json"))
    # DeepSeek Sparse Attention's indexer is neither converted nor read (dense latent attention
    # up to index_topk tokens: ModelConfig.sparse_attention_topk), so the shape leaves it out.
    want = sum(p.numel() for n, p in model.named_parameters() if ".indexer." not in n)
    assert _total_params(shape, model.config.vocab_size) == want, family


def test_from_config_takes_the_checkpoint_dtype(tiny_config):
  assert ModelShape.from_config(tiny_config).bytes_per_param == 4  # float32 source
  assert ModelShape.from_config(tiny_config, bytes_per_param=2).expert_bytes == 3 * 32 * 16 * 2


def test_model_file_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="configs/models"):
    ModelShape.load(tmp_path / "missing.json")
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="bad.json: not valid JSON"):
    ModelShape.load(bad)
  with open(os.path.join(CONFIGS, "models", "qwen3.5-35b-a3b.json")) as f:
    hf = json.load(f)
  hf["text_config"]["layer_types"] = hf["text_config"]["layer_types"][:-1]
  bad.write_text(json.dumps(hf))
  with pytest.raises(ValueError, match=r"bad.json: .*layer_types has 39 entries"):
    ModelShape.load(bad)
  hf["text_config"].pop("layer_types")
  hf["text_config"].pop("linear_num_value_heads")
  bad.write_text(json.dumps(hf))
  with pytest.raises(ValueError, match="bad.json: .*lacks the required key 'linear_num_value_h"):
    ModelShape.load(bad)


def test_int8_expert_bytes_count_weights_and_scales():
  """int8 experts (docs/ftw.md): one byte a weight, then float32 scales of the 2F + D rows
  from byte 3·F·D rounded up to 64: 1.5e6 weights -> 1_500_032, then 4 · 2000 bytes (half of
  the bf16 expert's 3e6, plus 0.27%)."""
  int8 = dataclasses.replace(SHAPE, expert_format="int8")
  assert int8.expert_bytes == 1_500_032 + 4 * (2 * 500 + 1000)
  odd = dataclasses.replace(SHAPE, hidden=3, expert_ffn=7, expert_format="int8")
  assert odd.expert_bytes == 64 + 4 * (2 * 7 + 3)  # 63 weight bytes, padded to 64
  assert int8.dense_bytes_per_layer == SHAPE.dense_bytes_per_layer  # dense weights unchanged
  with pytest.raises(ValueError, match="expert_format must be one of"):
    dataclasses.replace(SHAPE, expert_format="int3")


def test_int4_expert_bytes_count_codes_and_row_parameters():
  """int4 experts (docs/ftw.md): half a byte a weight from byte 0, then from 3·F·D/2 rounded
  up to 64 each row's 8 bytes of steps and 2 bytes per 32 inputs. Qwen3-30B-A3B's expert (F =
  768, D = 2048): 2,359,296 code bytes, (2·768 + 2048)·8 + 6·768·2048/32 = 323,584 parameter
  bytes: 0.291 of its bf16 bytes."""
  s = dataclasses.replace(SHAPE, hidden=2048, expert_ffn=768, expert_format="int4")
  assert s.expert_bytes == 2_359_296 + (2 * 768 + 2048) * 8 + 6 * 768 * 2048 // 32 == 2_682_880
  with pytest.raises(ValueError, match="multiples of 32"):
    _ = dataclasses.replace(SHAPE, expert_format="int4").expert_bytes  # F = 500


def test_mxfp4_expert_bytes_count_codes_scales_and_biases():
  """mxfp4 experts (docs/ftw.md): half a byte a weight, a scale byte per 32 weights, each part
  64-byte aligned, then the float32 biases. gpt-oss-20b's expert: 3·2880² = 24,883,200
  weights -> 12,441,600 code bytes and 777,600 scale bytes (both multiples of 64), then
  4 · 3 · 2880 bias bytes = 13,253,760: 0.266 of its bf16 bytes."""
  s = ModelShape.load(os.path.join(CONFIGS, "models", "gpt-oss-20b.json"))
  mxfp4 = dataclasses.replace(s, expert_format="mxfp4")
  assert mxfp4.expert_bytes == 12_441_600 + 777_600 + 4 * 3 * 2880 == 13_253_760
  assert mxfp4.dense_bytes_per_layer == s.dense_bytes_per_layer


def test_prefetches_share_the_link_and_host_memory():
  # (2 hits, 1 fill, 1 host) lasts 1.83 ms. + 2 prefetches: link = 0.3 + 2 · 0.3 = 0.9 ms,
  # within the step; host: 3e6 bytes at B_res = 10 GB/s during the link, 0.3 ms, as before:
  # 1.83 ms. + 6 prefetches: link = 2.1 ms, longer than the step: 2.1 ms. Without overlap
  # the copies add: 2.04 + 0.6 = 2.64 ms.
  np.testing.assert_allclose(cost.layer_step_time(HW, SHAPE, 2, 1, 1, prefetches=2), 1.83e-3,
                             rtol=tolerances.F64)
  np.testing.assert_allclose(cost.layer_step_time(HW, SHAPE, 2, 1, 1, prefetches=6), 2.1e-3,
                             rtol=tolerances.F64)
  # 4 host experts (12 MB, 0.6 ms at B_H alone) share host memory with 3 copies (0.9 ms): 9 MB
  # at B_res = 10 GB/s during them, the last 3 MB at B_H: 1.05 ms; + 1.5 ms = 2.55 ms.
  np.testing.assert_allclose(cost.layer_step_time(HW, SHAPE, 1, 0, 4), 2.1e-3,
                             rtol=tolerances.F64)
  np.testing.assert_allclose(cost.layer_step_time(HW, SHAPE, 1, 0, 4, prefetches=3), 2.55e-3,
                             rtol=tolerances.F64)
  serial = dataclasses.replace(HW, paths_overlap=False)
  np.testing.assert_allclose(cost.layer_step_time(serial, SHAPE, 2, 1, 1, prefetches=2),
                             2.64e-3, rtol=tolerances.F64)
  np.testing.assert_allclose(cost.layer_step_time(HW, SHAPE, 2, 1, 1, prefetches=0),
                             cost.layer_step_time(HW, SHAPE, 2, 1, 1), rtol=tolerances.F64)


def test_prefetch_room_is_the_links_idle_time():
  # (2 hits, 1 fill, 1 host) lasts 1.83 ms, its fill holds the link 0.3 ms: 1.53 ms idle =
  # 5 copies of 0.3 ms (capped by ``most``), which leave the step as long as it was; a CPU
  # profile has none.
  assert int(cost.prefetch_room(HW, SHAPE, 2, 1, 1, 8)) == 5
  np.testing.assert_allclose(cost.layer_step_time(HW, SHAPE, 2, 1, 1, prefetches=5), 1.83e-3,
                             rtol=tolerances.F64)
  assert int(cost.prefetch_room(HW, SHAPE, 2, 1, 1, 3)) == 3
  assert int(cost.prefetch_room(dataclasses.replace(HW, paths_overlap=False), SHAPE, 2, 1, 1,
                                8)) == 0
