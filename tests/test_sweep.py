"""The sweep: its rows equal direct replays and the cost model, Belady bounds every policy,
q* replays are shared only between profiles with equal fill tables, the CLI writes CSV and
plots, and bad input fails with a clear message."""

import csv
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from ftjax.research import cost, sweep, synthetic
from ftjax.cache import POLICIES

import tolerances

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = synthetic.RoutingModel(num_layers=4, num_experts=16, top_k=2, skew=0.8, reuse=0.4,
                               working_set=0.1, working_set_decay=0.9, prefill_reuse=0.4,
                               prefill_shift=0.3)
SHAPE = cost.ModelShape(name="small", num_layers=4, num_experts=16, top_k=2, hidden=64,
                        expert_ffn=32, bytes_per_param=2, dense_bytes_per_layer=1e5,
                        head_bytes=2e5)


def _hw(name, b_p, b_h):
  return cost.HardwareProfile(name=name, b_p=b_p, b_h=b_h, device_bw=500.0,
                              layer_overhead_s=1e-5, step_overhead_s=1e-4,
                              device_memory_gb=8.0, source="test")


@pytest.fixture(scope="module")
def small_trace():
  return synthetic.generate(SMALL, 120, seed=3, prefill_steps=10)


@pytest.fixture(scope="module")
def rows(small_trace):
  # a and b have the same B_P/B_H (equal q tables, one shared replay); c fills fewer.
  hardware = [_hw("a", 10.0, 20.0), _hw("b", 20.0, 40.0), _hw("c", 4.0, 40.0)]
  return sweep.sweep({"t": small_trace}, list(POLICIES), [0.0, 0.25, 0.5, 1.0], hardware,
                     {"t": SHAPE}, progress=False, hot_profiles={"t": _profile()})


def _profile():
  """static_hot's held-out profile: the same generator, other seed."""
  return sweep.expert_counts(synthetic.generate(SMALL, 120, seed=4, prefill_steps=10))


def test_static_hot_uses_the_held_out_profile_and_the_oracle_is_labelled(rows, small_trace):
  for policy, profile in (("static_hot", _profile()),
                          (sweep.ORACLE, sweep.expert_counts(small_trace))):
    row = next(r for r in rows if r.policy == policy and r.hardware == "a"
               and r.cache_fraction == 0.25)
    direct = sweep.replay(small_trace, "static_hot", 16, hot_experts=profile)
    assert row.miss_rate == pytest.approx(direct.miss_rate)
  held_out, oracle = (next(r for r in rows if r.policy == p and r.hardware == "a" and
                           r.cache_fraction == 0.25) for p in ("static_hot", sweep.ORACLE))
  assert oracle.miss_rate < held_out.miss_rate  # the replayed trace's own counts fit it best
  # Without a held-out profile only the labelled oracle is swept.
  alone = sweep.sweep({"t": small_trace}, ["static_hot"], [0.25], [_hw("a", 10.0, 20.0)],
                      {"t": SHAPE}, belady=False, progress=False)
  assert [r.policy for r in alone] == [sweep.ORACLE]


@pytest.mark.slow  # two spawned processes import jax and compile: ~14 s on 2 cores
def test_worker_processes_give_the_same_rows(small_trace):
  args = ({"t": small_trace}, ["freetoken", "static_hot"], [0.25, 0.5],
          [_hw("a", 10.0, 20.0), _hw("c", 4.0, 40.0)], {"t": SHAPE})
  kw = dict(progress=False, hot_profiles={"t": _profile()})
  one, two = sweep.sweep(*args, **kw), sweep.sweep(*args, **kw, workers=2)
  assert [repr(dataclasses.asdict(r)) for r in one] == [repr(dataclasses.asdict(r)) for r in two]


def test_split_warmup_holds_out_the_leading_steps(small_trace):
  warmup, rest = sweep.split_warmup(small_trace, 0.25)
  assert warmup.num_steps == 32 and rest.num_steps == 98
  np.testing.assert_array_equal(np.concatenate([warmup.ids, rest.ids]), small_trace.ids)
  np.testing.assert_array_equal(np.concatenate([warmup.phase, rest.phase]), small_trace.phase)
  with pytest.raises(ValueError, match=r"in \(0, 1\)"):
    sweep.split_warmup(small_trace, 1.0)


def test_rows_equal_direct_replays_and_the_cost_model(rows, small_trace):
  decode = small_trace.phase == 1
  for policy, hw in (("freetoken", _hw("c", 4.0, 40.0)), ("lru_fill", _hw("a", 10.0, 20.0)),
                     ("freetoken_lrfu", _hw("a", 10.0, 20.0))):
    row = next(r for r in rows if r.policy == policy and r.hardware == hw.name
               and r.cache_fraction == 0.25)
    direct = sweep.replay(small_trace, policy, row.cache_slots, (hw.b_p, hw.b_h))
    assert row.cache_slots == 16  # 0.25 of 4 x 16
    assert row.miss_rate == pytest.approx(direct.miss_rate)
    np.testing.assert_allclose(row.per_layer_miss_rate, direct.per_layer_miss_rate)
    assert row.fills_per_step == pytest.approx(direct.fills[decode].sum(1).mean())
    assert row.host_runs_per_step == pytest.approx(direct.host_runs[decode].sum(1).mean())
    want = cost.modeled_tok_s(hw, SHAPE, direct.hits[decode], direct.fills[decode],
                              direct.host_runs[decode])
    assert row.modeled_tok_s == pytest.approx(want)
    assert row.fill_gb_per_step == pytest.approx(row.fills_per_step * SHAPE.expert_bytes / 1e9)


def test_profiles_with_equal_fill_tables_share_a_replay_and_others_do_not(rows):
  def get(hw, frac=0.25):
    return next(r for r in rows if r.policy == "freetoken" and r.hardware == hw
                and r.cache_fraction == frac)
  a, b, c = get("a"), get("b"), get("c")
  assert (a.fills_per_step, a.host_runs_per_step) == (b.fills_per_step, b.host_runs_per_step)
  assert a.modeled_tok_s != b.modeled_tok_s  # same counts, different bandwidths
  assert c.fills_per_step < a.fills_per_step  # B_P/B_H = 0.1 fills fewer than 0.5


def test_belady_never_exceeds_any_policy(rows):
  for frac in (0.0, 0.25, 0.5, 1.0):
    bound = next(r for r in rows if r.policy == "belady" and r.cache_fraction == frac)
    others = [r for r in rows if r.policy != "belady" and r.cache_fraction == frac]
    assert len(others) == (len(POLICIES) + 1) * 3  # + static_hot_oracle
    assert all(bound.miss_rate <= r.miss_rate + tolerances.F64 for r in others)
  empty = [r for r in rows if r.cache_fraction == 0.0 and r.policy != "belady"]
  assert all(r.miss_rate == 1.0 and r.hits_per_step == 0 for r in empty)


def test_csv_and_plots(rows, tmp_path):
  main, per_layer = sweep.write_csv(rows, str(tmp_path))
  with open(main) as f:
    table = list(csv.DictReader(f))
  assert len(table) == len(rows)
  assert set(table[0]) == set(sweep.SweepRow.CSV_FIELDS)
  with open(per_layer) as f:
    assert len(list(csv.DictReader(f))) == 4 * sum(1 for r in rows if r.policy != "belady")
  pytest.importorskip("matplotlib")
  for path in sweep.plot(rows, str(tmp_path)):
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _cli(*args, cwd):
  return subprocess.run([sys.executable, "-m", "ftjax.research.sweep", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=600)


def test_cli_on_a_captured_style_trace_file(tmp_path, small_trace):
  path = str(tmp_path / "small.npz")
  dataclasses.replace(small_trace, metadata={}).save(path)
  shape_json = tmp_path / "shape.json"
  # A config.json with the trace's shape (a tiny qwen3_moe).
  shape_json.write_text(
      '{"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,'
      ' "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 16,'
      ' "num_experts_per_tok": 2, "moe_intermediate_size": 16, "rms_norm_eps": 1e-6,'
      ' "rope_theta": 10000.0, "max_position_embeddings": 128, "torch_dtype": "bfloat16"}')
  hw = tmp_path / "hw.yaml"
  hw.write_text("name: box\nb_p: 10\nb_h: 30\ndevice_bw: 300\nlayer_overhead_s: 1.0e-5\n"
                "step_overhead_s: 1.0e-4\ndevice_memory_gb: 8\nsource: test\n")
  out = tmp_path / "out"
  r = _cli(f"--traces={path}", "--cache_fractions=0.1,0.5",
           "--policies=freetoken,cpu_only,static_hot",
           f"--hardware={tmp_path}/*.yaml", f"--model_shape={shape_json}", f"--out={out}",
           cwd=str(tmp_path))
  assert r.returncode == 0, r.stderr
  files = set(os.listdir(out))
  assert {"results.csv", "per_layer.csv", "summary.json"} <= files
  with open(out / "results.csv") as f:
    table = list(csv.DictReader(f))
  assert {row["policy"] for row in table} == {"freetoken", "cpu_only", "static_hot",
                                              sweep.ORACLE, "belady"}
  assert len(table) == 2 * 5
  if pytest.importorskip("matplotlib"):
    assert {"miss_rate_small.png", "tok_s_small.png"} <= files


@pytest.mark.parametrize("args, message", [
    (["--traces=synthetic:nope"], "unknown synthetic trace"),
    (["--traces=missing.npz"], "not found"),
    (["--hardware=nowhere/*.yaml"], "matches no file"),
    (["--cache_fractions=1.5"], "cache fractions must be in"),
    (["--policies=mru"], "unknown cache policy"),
])
def test_cli_errors(args, message, tmp_path):
  hardware = os.path.join(REPO, "configs", "hardware", "*.yaml")
  r = _cli(f"--hardware={hardware}", *args, "--synthetic_steps=5", f"--out={tmp_path}",
           cwd=str(tmp_path))
  assert r.returncode != 0
  assert message in r.stderr
  assert "Traceback" not in r.stderr


def test_trace_and_shape_must_match(small_trace):
  assert sweep.check_shape(small_trace, SHAPE) is SHAPE
  with pytest.raises(ValueError, match="pass the matching --model_shape"):
    sweep.check_shape(small_trace, dataclasses.replace(SHAPE, num_layers=6))
