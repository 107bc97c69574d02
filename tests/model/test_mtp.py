"""The multi-token-prediction (MTP) head of the hybrid families (issue 30, part 1): converted
from ``mtp.*`` tensors, its logits against an independent float64 reference.

transformers does not implement the MTP head (it skips ``mtp.*``), but it implements the
decoder layer the head wraps. The reference is that: a transformers decoder layer (a second
random model's full-attention layer, whose tensors become the checkpoint's ``mtp.layers.0``),
transformers' RMSNorm for the three norms and a float64 ``fc``, all in float64, on the float64
model's final hidden states, as llama.cpp and vLLM feed the head.
"""

import io
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from scipy import stats

import ftjax
from ftjax.decode import run_decode
from ftjax.experts import BankExperts
from ftjax.model.transformer import init_mtp_state, init_state, param_name
from ftjax.runtime import speculative
from ftjax.runtime.speculative import accept_sampled

import conftest
import tolerances

NAMES = ["qwen3_next", "qwen3_5_moe_text"]
T = 24  # prompt tokens; the head predicts tokens 2 .. T - 1 from positions 0 .. T - 3


def _norm_class(hf_model):
  return type(hf_model.model.norm)


def _add_mtp(name: str, hf_model, path: str, *, config_key: bool):
  """Adds an MTP head to the checkpoint at ``path``: layer 3 (full attention) of a second
  random model of the same config as ``mtp.layers.0``, and random fc and norms. Returns the
  float64 reference modules."""
  donor = conftest.build_hybrid_model(name, seed=7)
  donor.config._experts_implementation = "eager"  # grouped_mm has no float64
  donor_dir = path + "-donor"
  conftest.save_hf_checkpoint(donor, donor_dir, **conftest.HYBRID_CHECKPOINTS[name][2])
  donor_tensors = {}
  for f in os.listdir(donor_dir):
    if f.endswith(".safetensors"):
      donor_tensors.update(load_file(os.path.join(donor_dir, f)))
  d = hf_model.config.hidden_size
  gen = torch.Generator().manual_seed(3)
  norms = {}
  for key in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
    norms[key] = _norm_class(hf_model)(d, eps=hf_model.config.rms_norm_eps)
    with torch.no_grad():
      norms[key].weight.copy_(0.2 * torch.randn(d, generator=gen))
  fc = 0.2 * torch.randn(d, 2 * d, generator=gen)
  mtp = {f"mtp.{k}.weight": m.weight.detach().numpy() for k, m in norms.items()}
  mtp["mtp.fc.weight"] = fc.numpy()
  layer = "model.layers.3."
  mtp.update({"mtp.layers.0." + n[len(layer):]: v for n, v in donor_tensors.items()
              if n.startswith(layer)})
  files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
  last = os.path.join(path, sorted(files)[-1])
  tensors = load_file(last)
  tensors.update(mtp)
  save_file(tensors, last)
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      meta = json.load(f)
    meta["weight_map"].update({n: os.path.basename(last) for n in mtp})
    with open(index, "w") as f:
      json.dump(meta, f)
  if config_key:
    with open(os.path.join(path, "config.json")) as f:
      config = json.load(f)
    config["mtp_num_hidden_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(config, f)
  return {"norms": {k: m.double() for k, m in norms.items()}, "fc": fc.double(),
          "layer": donor.model.layers[3].double()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> (float64 transformers model, reference MTP modules, loaded ftjax model)."""
  out = {}
  for name in NAMES:
    hf_model = conftest.build_hybrid_model(name)
    path = conftest.save_hf_checkpoint(hf_model, str(tmp_path_factory.mktemp(name) / "hf"),
                                       **conftest.HYBRID_CHECKPOINTS[name][2])
    # Qwen3.5 names its MTP layers in config.json, Qwen3-Next's are counted by the converter.
    ref = _add_mtp(name, hf_model, path, config_key=name != "qwen3_next")
    ftw_dir = ftjax.convert_hf(path, tmp_path_factory.mktemp(name) / "ftw", dtype="float32",
                               show_progress=False)
    hf_model.config._experts_implementation = "eager"  # grouped_mm has no float64
    out[name] = (hf_model.double(), ref, ftjax.load(ftw_dir))
  return out


@torch.no_grad()
def _reference(hf_model, ref, ids):
  """float64 MTP logits [T - 2, V] at positions 0 .. T - 3 (reading tokens 1 .. T - 2)."""
  ids_t = torch.tensor(ids[None])
  hidden = hf_model.model(ids_t).last_hidden_state[:, :-2]  # after the final norm
  embed = hf_model.model.embed_tokens(ids_t[:, 1:-1])
  z = torch.cat([ref["norms"]["pre_fc_norm_embedding"](embed),
                 ref["norms"]["pre_fc_norm_hidden"](hidden)], dim=-1) @ ref["fc"].T
  t = z.shape[1]
  positions = torch.arange(t)[None]
  rotary = hf_model.model.rotary_emb(z, positions)
  mask = torch.triu(torch.full((t, t), float("-inf"), dtype=torch.float64), 1)[None, None]
  out = ref["layer"](z, position_embeddings=rotary, attention_mask=mask, position_ids=positions)
  out = out[0] if isinstance(out, tuple) else out
  return hf_model.lm_head(ref["norms"]["norm"](out))[0].numpy()


def _ftjax_mtp(model, ids, kernels):
  """The head's logits over the same positions: the whole prompt at once, and again with the
  last position stepped alone on the KV cache the others left."""
  module = nnx.merge(model.graphdef, model.params)
  c = model.config
  experts = BankExperts(bank=model.bank, ffn_dim=c.moe_intermediate_size, kernels=kernels)
  ids2 = jnp.asarray(ids[None], jnp.int32)
  positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
  _, experts, hidden, _, _ = module.hidden_and_logits(
      init_state(c, 1, len(ids)), ids2, positions, experts, kernels=kernels, fresh=True)
  n = len(ids) - 2
  caches = init_mtp_state(c, 1, n)
  _, _, _, whole = module.mtp_step(caches, jnp.zeros((), jnp.int32), hidden[:, :n],
                                   ids2[:, 1:n + 1], positions[:, :n], experts, kernels=kernels,
                                   fresh=True)
  caches, _, _, head = module.mtp_step(caches, jnp.zeros((), jnp.int32), hidden[:, :n - 1],
                                       ids2[:, 1:n], positions[:, :n - 1], experts,
                                       kernels=kernels, fresh=True)
  _, _, _, last = module.mtp_step(caches, jnp.asarray(n - 1, jnp.int32), hidden[:, n - 1:n],
                                  ids2[:, n:n + 1], positions[:, n - 1:n], experts,
                                  kernels=kernels)
  return np.asarray(whole[0]), np.concatenate([np.asarray(head[0]), np.asarray(last[0])])


def test_converted_config_has_the_mtp_layer(checkpoints):
  for name in NAMES:
    model = checkpoints[name][2]
    assert model.config.mtp_layers == 1
    assert model.bank.shape[0] == model.config.num_layers + 1  # the head's experts: layer 4
    names = {param_name(p) for p, _ in nnx.to_flat_state(model.params)}
    assert {"mtp.w_fc_dx", "mtp.embed_norm.scale", "mtp.hidden_norm.scale",
            "mtp.final_norm.scale", "mtp.layers.0.attn.w_gate_had"} <= names


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_mtp_logits_match_the_float64_reference(checkpoints, name, kernels):
  hf_model, ref, model = checkpoints[name]
  ids = np.random.default_rng(5).integers(0, model.config.vocab_size, T)
  want = _reference(hf_model, ref, ids)
  whole, stepped = _ftjax_mtp(model, ids, kernels)
  tolerances.assert_close(whole, want, tolerances.HF_PARITY, floor=1.0, what=f"{name} whole")
  tolerances.assert_close(stepped, want, tolerances.HF_PARITY, floor=1.0,
                          what=f"{name} last position stepped on the KV cache")


@pytest.mark.parametrize("name", NAMES)
def test_plain_decode_of_a_model_with_mtp_is_unchanged(checkpoints, name):
  """The head's experts in the bank and the cache change nothing for plain decoding."""
  hf_model, _, model = checkpoints[name]
  ids = np.random.default_rng(9).integers(0, model.config.vocab_size, 17)
  with torch.no_grad():
    want = hf_model.generate(torch.tensor(ids[None]), max_new_tokens=8, do_sample=False,
                             min_new_tokens=8, pad_token_id=0)[0, len(ids):].tolist()
  engine = ftjax.Engine(model, kernels="ffi", cache_slots=6, policy="lru_fill")
  assert engine.generate(ids.tolist(), 8, greedy=True) == want


def test_a_checkpoint_whose_mtp_tensors_were_dropped(tmp_path, capfd):
  """config.json names MTP layers, the tensors are gone: converted without MTP, said so, and
  asking the model for its head is a clear error."""
  name = "qwen3_5_moe_text"
  hf_model = conftest.build_hybrid_model(name)
  path = conftest.save_hf_checkpoint(hf_model, str(tmp_path / "hf"))
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  config["mtp_num_hidden_layers"] = 1
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  model = ftjax.load(ftjax.convert_hf(path, tmp_path / "ftw", dtype="float32",
                                      show_progress=False))
  assert "no mtp.* tensors; converting without MTP" in capfd.readouterr().err
  assert model.config.mtp_layers == 0
  module = nnx.merge(model.graphdef, model.params)
  with pytest.raises(ValueError, match="no multi-token-prediction"):
    init_mtp_state(model.config, 1, 8)
  with pytest.raises(ValueError, match="its checkpoint ships none"):
    module.mtp_step((), jnp.zeros((), jnp.int32), jnp.zeros((1, 1, 32)),
                    jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), None)


# -- Speculative decoding (issue 30, part 2): greedy, equal to plain greedy decoding ----------

ENGINES = {"bank": dict(kernels="ffi"), "cache": dict(kernels="ffi", cache_slots=6,
                                                      policy="lru_fill")}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("where", list(ENGINES))
def test_speculative_greedy_equals_plain_greedy(checkpoints, name, where):
  _, _, model = checkpoints[name]
  engine = ftjax.Engine(model, max_seq_len=128, **ENGINES[where])
  ids = np.random.default_rng(11).integers(0, model.config.vocab_size, 13).tolist()
  want = engine.generate(ids, 20, greedy=True)
  for k in range(1, 5):
    got = engine.generate_speculative(ids, 20, draft_tokens=k)
    assert got.tokens == want, (name, where, k)
    assert got.steps >= 1 and len(got.accepted) == k
    assert all(0 <= a <= got.steps for a in got.accepted)
    # accepted counts fall with the draft position: draft i + 1 needs draft i
    assert all(x >= y for x, y in zip(got.accepted, got.accepted[1:]))
    assert (len(got.tokens) - 1) <= got.steps * (k + 1)


@pytest.mark.parametrize("name", NAMES)
def test_speculative_with_forced_drafts_equals_plain_greedy(checkpoints, name):
  """Drafts forced to the plain greedy tokens (with probability p, else the head's own, or
  forced wrong): every acceptance count a verify step can have, each rollback of the
  recurrent states, and still the plain greedy tokens."""
  _, _, model = checkpoints[name]
  engine = ftjax.Engine(model, max_seq_len=128, **ENGINES["cache"])
  v = model.config.vocab_size
  ids = np.random.default_rng(13).integers(0, v, 11).tolist()
  plain = np.asarray(engine.generate(ids, 24, greedy=True))
  rng = np.random.default_rng(0)
  for p in (1.0, 0.7, 0.4, 0.0):
    forced = np.where(rng.random(plain.size) < p, plain, (plain + 1) % v)
    for k in (1, 2, 4):
      got = engine.generate_speculative(ids, 24, draft_tokens=k, forced_drafts=forced)
      assert got.tokens == plain.tolist(), (name, p, k)
      if p == 1.0:  # every draft accepted, but where it proposes past max_new_tokens
        assert got.accepted[0] == got.steps and got.steps <= -(-23 // (k + 1)) + 1
      if p == 0.0:
        assert got.accepted == [0] * k and got.steps == 23


@pytest.mark.parametrize("name", NAMES)
def test_adaptive_draft_length_equals_plain_greedy(checkpoints, name):
  """Each verify step drafts 0 .. 3 tokens, the rule's choice: still the plain greedy tokens;
  with every draft forced right it drafts the most, with every draft forced wrong it mostly
  drafts none (probing with one draft now and then); the engine measures the lengths' seconds."""
  _, _, model = checkpoints[name]
  engine = ftjax.Engine(model, max_seq_len=128, **ENGINES["cache"])
  v = model.config.vocab_size
  ids = np.random.default_rng(13).integers(0, v, 11).tolist()
  plain = np.asarray(engine.generate(ids, 40, greedy=True))
  rng = np.random.default_rng(0)
  # Measured costs: the same tokens, and the lengths are the engine's choice from its own
  # timings (on this tiny model a step's fixed overhead makes them near-equal, so the choices
  # below are checked with the modelled bytes, which are deterministic).
  for p, costs in [(1.0, "measured"), (0.4, "measured"), (0.0, "measured"), (1.0, "modelled"),
                   (0.4, "modelled"), (0.0, "modelled")]:
    forced = np.where(rng.random(plain.size) < p, plain, (plain + 1) % v)
    got = engine.generate_speculative(ids, 40, draft_tokens=3, forced_drafts=forced,
                                      adaptive=True, draft_costs=costs)
    assert got.tokens == plain.tolist(), (name, p)
    assert sum(got.lengths) == got.steps and len(got.lengths) == 4
    assert len(got.costs) == 4 and all(c > 0 for c in got.costs)
    if p == 1.0 and costs == "modelled":
      assert got.lengths[3] >= got.steps // 2, got.lengths
    if p == 0.0 and costs == "modelled":
      assert got.lengths[0] >= got.steps // 2 and got.accepted == [0, 0, 0], got.lengths
  # The engine measured the lengths it ran more than once (a program's first run is not a
  # sample), and ranks with those seconds from then on.
  seconds = engine.executor.verify_seconds[(3, False)]
  assert np.isfinite(seconds).sum() >= 2 and np.all(seconds[np.isfinite(seconds)] > 0), seconds


def test_the_adaptive_rule_maximises_expected_tokens_per_byte(checkpoints):
  """The rule's choice against a brute force over the draft lengths, and its cost model
  against the bytes in the model's file."""
  model = checkpoints["qwen3_next"][2]
  c = model.config
  cost = speculative.step_costs(model, 4)
  assert np.all(np.diff(cost) > 0)
  dense = sum(t["nbytes"] for n, t in model.storage.index["tensors"].items()
              if not n.startswith(("embed", "mtp.")))
  mtp = sum(t["nbytes"] for n, t in model.storage.index["tensors"].items()
            if n.startswith("mtp."))
  plain = dense + (c.num_layers + 1) * c.top_k * model.expert_bytes + mtp  # with the catch-up
  assert cost[0] == pytest.approx(plain, rel=1e-6)
  for alpha in (0.1, 0.5, 0.8, 0.97):
    tried = np.full(4, 1e4, np.float32)
    draft = speculative.Draft(
        caches=(), length=0, hidden=0, tokens=0, valid=0, count=0, done=False, steps=0,
        accepted=0, forced=0, tried=jnp.asarray(tried), kept=jnp.asarray(alpha * tried),
        chosen=0, idle=jnp.zeros((), jnp.int32),
        probe=jnp.asarray(speculative.PROBE_EVERY, jnp.int32))
    expected = 1 + np.concatenate([[0], np.cumsum(np.cumprod(np.full(4, alpha)))])
    assert int(speculative.choose_draft_length(draft, jnp.asarray(cost))) == int(
        np.argmax(expected / cost)), alpha
  never = draft.replace(kept=jnp.zeros(4, jnp.float32))
  assert int(speculative.choose_draft_length(never, jnp.asarray(cost))) == 0
  probe = never.replace(idle=jnp.asarray(speculative.PROBE_EVERY, jnp.int32))
  assert int(speculative.choose_draft_length(probe, jnp.asarray(cost))) == 1
  # The wait before a probe doubles after each probe that keeps nothing, up to a bound, and
  # resets after one that keeps; a step that drafted on its own (not idle) leaves it.
  after = speculative.after_probe
  for wait, idle, kept, want in [(16, 16, 0, 32), (32, 40, 0, 64), (16, 16, 1, 16),
                                 (128, 128, 2, 16), (256, 300, 0, 256), (64, 0, 0, 64)]:
    before = never.replace(idle=jnp.asarray(idle, jnp.int32),
                           probe=jnp.asarray(wait, jnp.int32))
    assert int(after(before, before, 1, jnp.asarray(kept)).probe) == want, (wait, idle, kept)
  assert after(before, before, 0, 0) is before  # no draft: nothing changes
  longer = probe.replace(probe=jnp.asarray(32, jnp.int32))
  assert int(speculative.choose_draft_length(longer, jnp.asarray(cost))) == 0


def test_measured_costs_replace_the_modelled_ones():
  """``calibrated_costs``: the modelled bytes until a length is measured; then that length's
  seconds, and the others' bytes scaled by the measured lengths' median seconds per byte."""
  modelled = np.asarray([100.0, 150.0, 200.0], np.float32)
  np.testing.assert_array_equal(speculative.calibrated_costs(modelled, np.full(3, np.nan)),
                                modelled)
  got = speculative.calibrated_costs(modelled, np.asarray([0.05, np.nan, 0.2]))
  # 0.05 / 100 and 0.2 / 200: a median of 7.5e-4 s per byte for the unmeasured length
  np.testing.assert_allclose(got, [0.05, 150 * 7.5e-4, 0.2], rtol=1e-6)
  # Compute-bound drafting: measured seconds can reverse what bytes would pick
  tried = jnp.full(2, 1e4, jnp.float32)
  draft = speculative.Draft(
      caches=(), length=0, hidden=0, tokens=0, valid=0, count=0, done=False, steps=0,
      accepted=0, forced=0, tried=tried, kept=0.8 * tried, chosen=0,
      idle=jnp.zeros((), jnp.int32), probe=jnp.asarray(speculative.PROBE_EVERY, jnp.int32))
  assert int(speculative.choose_draft_length(draft, jnp.asarray(modelled))) > 0
  slow = speculative.calibrated_costs(modelled, np.asarray([0.06, 0.2, 0.3]))
  assert int(speculative.choose_draft_length(draft, jnp.asarray(slow))) == 0


def test_speculative_stops_where_plain_decoding_stops(checkpoints):
  _, _, model = checkpoints["qwen3_next"]
  engine = ftjax.Engine(model, kernels="ffi", max_seq_len=128)
  ids = np.random.default_rng(12).integers(0, model.config.vocab_size, 9).tolist()
  plain = engine.generate(ids, 24, greedy=True)
  stop = plain[7]
  want = engine.generate(ids, 24, greedy=True, stop_tokens=[stop])
  assert want[-1] == stop and len(want) <= 8
  for k in (1, 3):
    assert engine.generate_speculative(ids, 24, draft_tokens=k,
                                       stop_tokens=[stop]).tokens == want
    for n in (1, 2, 5):  # max_new_tokens cuts a verify step's run
      assert engine.generate_speculative(ids, n, draft_tokens=k).tokens == plain[:n]


def test_speculative_needs_an_mtp_head(tmp_path, checkpoints):
  model = ftjax.load(ftjax.convert_hf(
      conftest.save_hf_checkpoint(conftest.build_hybrid_model("qwen3_next"),
                                  str(tmp_path / "hf")),
      tmp_path / "ftw", dtype="float32", show_progress=False))
  engine = ftjax.Engine(model, kernels="ffi")
  with pytest.raises(ValueError, match="needs the model's multi-token-prediction head"):
    engine.generate_speculative([1, 2, 3], 4)
  with pytest.raises(ValueError, match="draft_tokens must be in"):
    ftjax.Engine(checkpoints["qwen3_next"][2]).generate_speculative([1, 2, 3], 4,
                                                                    draft_tokens=5)


def test_decode_cli_speculative(checkpoints, tmp_path):
  """``python -m ftjax.decode --speculative=mtp --greedy``: the plain greedy text, and a line
  on the drafts."""
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
  model = checkpoints["qwen3_next"][2]
  path = shutil.copytree(model.path, tmp_path / "ftw")  # with a word-level tokenizer of
  words = Tokenizer(models.WordLevel(  # the tiny vocabulary
      {f"w{i}": i for i in range(model.config.vocab_size)}, unk_token="w0"))
  words.pre_tokenizer = pre_tokenizers.Whitespace()
  words.save(str(path / "tokenizer.json"))
  prompt = " ".join(f"w{i}" for i in (5, 17, 33, 2, 60, 8, 41))
  runs = {}
  for mode in ("none", "mtp"):
    out, log = io.StringIO(), io.StringIO()
    runs[mode] = run_decode(str(path), prompt, max_new_tokens=10, greedy=True,
                            kernels="ffi", speculative=mode, draft_tokens=3, prefault=False,
                            out=out, log=log)
  assert runs["mtp"].generation.tokens == runs["none"].generation.tokens
  assert len(runs["mtp"].generation.tokens) == 10
  assert "speculative: mtp, 3 draft tokens" in log.getvalue()
  log = io.StringIO()
  adaptive = run_decode(str(path), prompt, max_new_tokens=10, greedy=True, kernels="ffi",
                        speculative="mtp", draft_tokens=3, adaptive_draft=True, prefault=False,
                        out=io.StringIO(), log=log)
  assert adaptive.generation.tokens == runs["none"].generation.tokens
  assert "steps with 0 .. 3 drafts [" in log.getvalue()
  with pytest.raises(ValueError, match="pass --speculative=mtp with it"):
    run_decode(str(path), prompt, adaptive_draft=True, out=io.StringIO(), log=io.StringIO())
  sampled = [run_decode(str(path), prompt, max_new_tokens=10, greedy=False, temperature=0.9,
                        top_p=0.9, seed=5, kernels="ffi", speculative="mtp", draft_tokens=2,
                        prefault=False, out=io.StringIO(), log=io.StringIO())
             for _ in range(2)]
  assert len(sampled[0].generation.tokens) == 10
  assert sampled[0].generation.tokens == sampled[1].generation.tokens  # a seed's draws


# -- Speculative sampling: rejection sampling keeps the model's distribution ----------------


def _chi_square_p(counts, probs):
  """The chi-square test's p-value of ``counts`` against ``probs``, cells with an expected
  count under 5 merged into one."""
  counts = np.asarray(counts, float)
  expected = np.asarray(probs, float) / np.sum(probs, dtype=float) * counts.sum()
  assert np.all(counts[expected == 0] == 0), "a token of probability 0 was drawn"
  small = expected < 5
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return stats.chisquare(obs, exp).pvalue


def test_accept_sampled_keeps_the_target_distribution():
  """One verify step's acceptance, 200,000 times (drafts drawn from q, some of them forced
  one-hot, p and q with tokens of probability 0): token j, where the step emits it (the
  drafts before it accepted), follows p_j, the distribution plain sampling draws from."""
  rng = np.random.default_rng(0)
  k, v, n = 3, 7, 200_000
  p = rng.dirichlet(np.ones(v), k + 1).astype(np.float32)
  p[1, 2] = p[3, 0] = 0.0  # tokens the model never picks
  q = rng.dirichlet(np.full(v, 0.5), k).astype(np.float32)
  q[0, 4] = 0.0  # a token the head never drafts
  q[2] = np.eye(v, dtype=np.float32)[5]  # a forced draft
  p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)

  def one(key):
    d_key, a_key = jax.random.split(key)
    drafts = jax.random.categorical(d_key, jnp.log(jnp.asarray(q))).astype(jnp.int32)
    return accept_sampled(a_key, drafts, jnp.asarray(q), jnp.asarray(p))

  a, tokens = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(2), n))
  a, tokens = np.asarray(a), np.asarray(tokens)
  assert 0 < a.mean() < k and np.all(np.bincount(a, minlength=k + 1) > 0)  # every outcome
  for j in range(k + 1):
    emitted = tokens[a >= j, j]
    assert _chi_square_p(np.bincount(emitted, minlength=v), p[j]) > 1e-3, j


@pytest.mark.parametrize("name", NAMES)
def test_speculative_sampling_follows_the_model_distribution(checkpoints, name):
  """Three sampled tokens (temperature 1.3, top-k 3) after a prompt, 600 seeds, with 2 drafts
  a verify step: the triples' counts against the exact distribution from the float64
  transformers model (p(t1) p(t2 | t1) p(t3 | t1, t2) under the same temperature and
  filter), chi-square. The random head's top 3 rarely meet the model's, so the draft for the
  second token is forced to its likeliest value after the likeliest first token (a one-hot
  draft distribution, accepted or not by the same rule), and the third is the head's own.
  Qwen3.5 runs with the adaptive draft length (0 .. 2 drafts a step)."""
  hf_model, _, model = checkpoints[name]
  engine = ftjax.Engine(model, max_seq_len=64, **ENGINES["cache"])
  ids = np.random.default_rng(21).integers(0, model.config.vocab_size, 9)
  temperature, top_k, runs = 1.3, 3, 600

  def probs(logits):  # the filtered, tempered distribution over the vocabulary
    z = logits / temperature
    z = np.where(z >= np.sort(z, axis=-1)[..., -top_k, None], z, -np.inf)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  exact = {}
  with torch.no_grad():
    first = probs(hf_model(torch.tensor(ids[None])).logits[0, -1].numpy())
    for t1 in np.flatnonzero(first):
      seqs = torch.tensor([np.append(ids, [t1, t2]) for t2 in range(model.config.vocab_size)])
      logits = hf_model(seqs).logits.numpy()
      second = probs(logits[0, -2])
      exact[t1] = second
      for t2 in np.flatnonzero(second):
        third = probs(logits[t2, -1])
        for t3 in np.flatnonzero(third):
          exact[(t1, t2, t3)] = first[t1] * second[t2] * third[t3]
  forced = [-1, int(np.argmax(exact[int(np.argmax(first))])), -1]
  counts, accepted, steps = {}, np.zeros(2, int), 0
  for seed in range(runs):
    got = engine.generate_speculative(ids.tolist(), 3, greedy=False, temperature=temperature,
                                      top_k=top_k, seed=seed, draft_tokens=2,
                                      forced_drafts=forced, adaptive=name != "qwen3_next")
    counts[tuple(got.tokens)] = counts.get(tuple(got.tokens), 0) + 1
    accepted, steps = accepted + got.accepted, steps + got.steps
  assert 30 <= accepted[0] <= steps - 30  # first drafts both accepted and rejected, often
  cells = [c for c in exact if isinstance(c, tuple)]
  assert set(counts) <= set(cells), "a triple outside the top-3 filters"
  assert _chi_square_p([counts.get(c, 0) for c in cells], [exact[c] for c in cells]) > 1e-3
