"""The q* split calibrated while decoding (ftjax.runtime.calibration): the guard against a
simulated machine whose true costs the profile misstates, the rates it fits, and in the engine
the same tokens as the dense path while its strategy changes under it."""

import logging

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

import ftjax
from ftjax.runtime import model as model_lib
from ftjax.runtime.calibration import FILL_ALL, HOST_ALL, STRATEGIES, SplitCalibrator
from ftjax.server.metrics import EngineTotals

from conftest import scaled_params

EXPERT_BYTES = 1 << 20
GB = EXPERT_BYTES / 1e9


class Machine:
  """Seconds a decode chunk takes: ``base`` a step, ``hit`` / ``fill`` / ``host`` seconds an
  expert, and ``misses`` distinct misses a step, split by the q* rule of the bandwidths the
  calibrator gives (fill_count's arithmetic: q = m·B_P/B_H, all when B_P >= B_H)."""

  def __init__(self, base, hit, fill, host, misses=24, hits=8, noise=0.0, seed=0):
    self.base, self.hit, self.fill, self.host = base, hit, fill, host
    self.misses, self.hits, self.noise = misses, hits, noise
    self.rng = np.random.default_rng(seed)

  def chunk(self, bandwidths, steps=8):
    b_p, b_h = (float(b) for b in bandwidths)
    m = self.misses
    q = m if b_p >= b_h else int(round(m * b_p / b_h))
    fills, host = q * steps, (m - q) * steps
    hits = self.hits * steps
    seconds = (self.base * steps + self.hit * hits + self.fill * fills + self.host * host)
    seconds *= 1 + self.noise * self.rng.standard_normal()
    return seconds, steps, hits, fills, host

  def best(self):
    return min(STRATEGIES, key=lambda s: self.per_step(s))

  def per_step(self, strategy, rates=None):
    m = self.misses
    q = {"fill": m, "host": 0}.get(strategy)
    if q is None:
      b_p, b_h = rates
      q = m if b_p >= b_h else int(round(m * b_p / b_h))
    return self.base + self.hit * self.hits + self.fill * q + self.host * (m - q)


def run(cal, machine, chunks):
  """Feeds ``chunks`` programs of ``machine`` to ``cal`` as the executor does; returns the
  strategy of each."""
  ran = []
  for _ in range(chunks):
    strategy, bandwidths = cal.decode_bandwidths()
    cal.observe(*machine.chunk(bandwidths), strategy=strategy)
    ran.append(strategy)
  return ran


# The true costs: a fill (copy, then the run from its slot) 3 ms, a host run 1 ms (the CPU
# backend's shape: fills are extra work) or the other way round (an accelerator's).
HOST_WINS = dict(base=2e-3, hit=0.2e-3, fill=3e-3, host=1e-3)
FILL_WINS = dict(base=2e-3, hit=0.2e-3, fill=0.5e-3, host=4e-3)


def true_bandwidths(costs):
  b_p = GB / costs["fill"]
  return (b_p, b_p + GB / costs["host"])


@pytest.mark.parametrize("costs", [HOST_WINS, FILL_WINS], ids=["host_wins", "fill_wins"])
@pytest.mark.parametrize("lie", ["host_25x", "fill_25x", "truth"])
def test_the_guard_reaches_the_best_strategy_within_64_steps(costs, lie, caplog):
  """From a profile that overstates the host (or the fill) bandwidth 25x, or the truth, the
  strategy in use after 8 chunks of 8 steps measures within 1.1x of the best of the three."""
  b_p, b_h = true_bandwidths(costs)
  b_res = b_h - b_p
  profile = {"host_25x": (b_p, b_p + 25 * b_res), "fill_25x": (25 * b_p, 25 * b_p + b_res),
             "truth": (b_p, b_h)}[lie]
  machine = Machine(**costs, noise=0.02)
  cal = SplitCalibrator(profile, EXPERT_BYTES)
  with caplog.at_level(logging.WARNING, logger="ftjax.runtime.calibration"):
    run(cal, machine, 8)
  best = min(machine.per_step(s, cal.rates()) for s in STRATEGIES)
  assert machine.per_step(cal.mode, cal.rates()) <= 1.1 * best
  # Each switch is logged with what each strategy measured.
  assert len(caplog.records) == len(cal.switches)
  for record, switch in zip(caplog.records, cal.switches):
    assert f"switching to {switch.after}" in record.getMessage()
  # It stays there (a probe now and then, never a switch back and forth).
  switches = len(cal.switches)
  ran = run(cal, machine, 96)
  assert len(cal.switches) == switches
  assert ran.count(cal.mode) >= 96 - 2 * (96 // cal.probe_every + 1)


@pytest.mark.parametrize("costs", [HOST_WINS, FILL_WINS], ids=["host_wins", "fill_wins"])
def test_the_fit_recovers_the_costs_and_rates(costs):
  """After the probes, the least-squares costs are the machine's (within 5%, 2% noise), and the
  re-solved rates are B_P = S / fill and B_H = B_P + S / host."""
  machine = Machine(**costs, noise=0.02, seed=3)
  cal = SplitCalibrator((10.0, 20.0), EXPERT_BYTES, probe_every=4)
  # Vary the misses so that the per-step and per-miss terms separate.
  for i in range(48):
    machine.misses = 8 + (i * 7) % 24
    run(cal, machine, 1)
  got = cal.summary()["costs_s"]
  assert got["fill"] == pytest.approx(costs["fill"], rel=0.05)
  assert got["host"] == pytest.approx(costs["host"], rel=0.05)
  np.testing.assert_allclose(cal.rates(), true_bandwidths(costs), rtol=0.06)


def test_a_split_within_the_margin_is_kept():
  """Where all three strategies measure within 1.1x, nothing switches."""
  machine = Machine(base=10e-3, hit=0.0, fill=1.0e-3, host=1.02e-3, noise=0.0)
  cal = SplitCalibrator(true_bandwidths({"fill": 1.0e-3, "host": 1.02e-3}), EXPERT_BYTES)
  run(cal, machine, 64)
  assert cal.mode == "split" and not cal.switches


def test_pure_strategies_are_bandwidth_pairs():
  """The first chunk runs the profile's split; then one probe of each pure strategy, as
  bandwidth pairs that fill every miss (B_P >= B_H) and none; then the split again."""
  cal = SplitCalibrator((10.0, 30.0), EXPERT_BYTES)
  name, pair = cal.decode_bandwidths()
  assert name == "split"
  np.testing.assert_allclose(pair, (10.0, 30.0))
  cal.observe(0.1, 8, 0, 8, 8, strategy=name)
  name, pair = cal.decode_bandwidths()
  assert name == "fill"
  np.testing.assert_allclose(pair, FILL_ALL)
  cal.observe(0.1, 8, 0, 16, 0, strategy=name)
  name, pair = cal.decode_bandwidths()
  assert name == "host"
  np.testing.assert_allclose(pair, HOST_ALL)
  cal.observe(0.1, 8, 0, 0, 16, strategy=name)
  assert cal.decode_bandwidths()[0] == "split" and cal.mode == "split" and cal.probes == 2
  assert FILL_ALL[0] >= FILL_ALL[1] and HOST_ALL[0] < 1e-5 * HOST_ALL[1]


@pytest.mark.parametrize("args,message", [(((0.0, 1.0), 10), "positive GB/s"),
                                          (((1.0, 2.0), 0), "expert_bytes")])
def test_bad_input_is_named(args, message):
  with pytest.raises(ValueError, match=message):
    SplitCalibrator(*args)


# -- In the engine ----------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def calibrated_model(request, tiny_config, tiny_hybrid_config):
  config = tiny_config if request.param == "qwen3_moe" else tiny_hybrid_config
  return scaled_params(model_lib.random_model(config, seed=5), 8.0)


def test_bad_options_are_named(calibrated_model):
  with pytest.raises(ValueError, match="calibrate_split must be one of"):
    ftjax.Engine(calibrated_model, kernels="xla", calibrate_split="yes")
  with pytest.raises(ValueError, match="has none"):
    ftjax.Engine(calibrated_model, kernels="xla", cache_slots=4, policy="lru_fill",
                 calibrate_split="on")


def test_auto_calibrates_a_profile_not_given_bandwidths(calibrated_model):
  engine = ftjax.Engine(calibrated_model, kernels="xla", cache_slots=4, bandwidths=(12.0, 24.0))
  assert engine.executor.calibrator is None and engine.stats()["calibration"] is None
  engine = ftjax.Engine(calibrated_model, kernels="xla", cache_slots=4, bandwidths=(12.0, 24.0),
                        calibrate_split="on")
  assert engine.executor.calibrator is not None


@pytest.mark.parametrize("slots", [3, 10])
def test_tokens_match_the_dense_path_while_the_strategy_changes(calibrated_model, slots):
  """A q* policy whose guard probes every other chunk and switches on any difference (margin
  1.0): every strategy runs, the cache fills and empties under it, and the greedy tokens are
  the dense path's."""
  c = calibrated_model.config
  prompt = np.random.default_rng(1).integers(0, c.vocab_size, 6)
  ref = ftjax.Engine(calibrated_model, kernels="xla").generate(prompt, 24)
  for policy in ("freetoken", "freetoken_cycle"):
    engine = ftjax.Engine(calibrated_model, kernels="xla", cache_slots=slots, policy=policy,
                          bandwidths=(12.0, 24.0), calibrate_split="on", decode_chunk=2)
    engine.executor.calibrator = SplitCalibrator((12.0, 24.0), calibrated_model.expert_bytes,
                                                 probe_every=2, margin=1.0)
    assert engine.generate(prompt, 24) == ref
    summary = engine.stats()["calibration"]
    assert summary["chunks"] >= 10 and summary["probes"] >= 3
    ran = {s["before"] for s in summary["switches"]} | {summary["strategy"]}
    assert summary["probes"] + len(ran) >= 3


def test_metrics_show_the_strategy_and_the_switches(calibrated_model):
  """The server's /metrics families (ftjax.server.metrics) read the engine's calibration."""
  engine = ftjax.Engine(calibrated_model, kernels="xla", cache_slots=4, policy="freetoken",
                        bandwidths=(12.0, 24.0), calibrate_split="on", decode_chunk=2)
  engine.executor.calibrator = SplitCalibrator((12.0, 24.0), calibrated_model.expert_bytes,
                                               probe_every=2, margin=1.0)
  engine.generate([1, 2, 3], 12)
  registry = CollectorRegistry()
  registry.register(EngineTotals(engine))
  text = generate_latest(registry).decode()
  cal = engine.calibration()
  for name in ("split", "fill", "host"):
    want = 1.0 if cal["strategy"] == name else 0.0
    assert f'ftjax_split_strategy{{strategy="{name}"}} {want}' in text
  assert f"ftjax_split_switches_total {float(len(cal['switches']))}" in text
  assert f"ftjax_split_probes_total {float(cal['probes'])}" in text
  assert 'ftjax_split_rate_gb_s{rate="fill"}' in text
  plain = CollectorRegistry()
  plain.register(EngineTotals(ftjax.Engine(calibrated_model, kernels="xla")))
  assert "ftjax_split" not in generate_latest(plain).decode()
