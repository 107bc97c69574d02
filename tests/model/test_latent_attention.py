"""Multi-head latent attention (deepseek_v3) beyond one forward: sessions that edit their
context and restore it from a checkpoint, and sequences that decode together in one batch, give
the tokens of a fresh engine alone; the engine's KV bytes are the latent's.

The model is transformers' DeepSeek-V3 at tiny, odd shapes (conftest ``HF_FAMILIES``), converted;
its parity with transformers is ``test_hf_parity``'s."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.model.config import from_hf_config
from ftjax.model.transformer import init_state
from ftjax.runtime import kv
from ftjax.runtime.executor import Generation
from ftjax.runtime.sampling import Sampling

import tolerances
from conftest import build_hf_model, save_hf_checkpoint

NEW = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  path = save_hf_checkpoint(build_hf_model("deepseek_v3"), str(tmp_path_factory.mktemp("ds")))
  ftw_dir = ftjax.convert_hf(path, tmp_path_factory.mktemp("ds") / "ftw", dtype="float32",
                             show_progress=False)
  loaded = ftjax.load(ftw_dir)
  # Sharper logits, distinct tokens (x3 makes the model so ill-conditioned that float32 orders
  # differ by 1e-5 of the logits on every path, the XLA one too).
  params = jax.tree.map(lambda x: x * 2.0, loaded.params)
  return dataclasses.replace(loaded, params=params)


def _ids(n, seed):
  return np.random.default_rng(seed).integers(0, 96, n).tolist()


def test_session_edits_and_checkpoints_are_exact(model, tmp_path):
  """A session's appended, truncated and rewritten contexts equal a full prefill; saved and
  restored (orbax, the latent cache and its empty value rows), it goes on as before."""
  engine = ftjax.Engine(model, kernels="ffi", prefill_chunk=16)
  session = ftjax.Session(engine)
  base = _ids(30, 1)
  for ids in (base, base + _ids(7, 2), base[:12] + _ids(9, 3), base[:12]):
    result = session.set_context(ids)
    tolerances.assert_close(result.last_logits, engine.forward_logits(ids)[-1], tolerances.F32,
                            floor=1.0, what=f"{len(ids)} tokens")
  ids = base[:12]
  assert session.save(tmp_path / "ckpt") == 0
  restored = ftjax.Session.restore(engine, tmp_path / "ckpt")
  want = engine.generate(ids, NEW)
  assert len(set(want)) > 1
  assert restored.generate(NEW) == want
  assert session.generate(NEW) == want


def test_sequences_in_one_batch_equal_each_alone(model):
  engine = ftjax.Engine(model, kernels="ffi", decode_chunk=3)
  prompts, new = [_ids(5, 4), _ids(19, 5), _ids(2, 6)], [9, 5, 7]
  alone = [engine.generate(p, n) for p, n in zip(prompts, new)]
  gens = []
  for p, n in zip(prompts, new):
    read = engine.executor.extend(engine.new_state(1, len(p) + n), p, start=0)
    gens.append(Generation(state=read.state, logits=read.logits, max_new=n,
                           sampling=Sampling.make(greedy=True), stops=(),
                           on_chunk=lambda tokens, halted, layers: not halted))
  batch = engine.executor.batch(3)
  for g in gens:
    engine.executor.join(batch, g)
  engine.executor.run(batch, None)
  assert [g.tokens for g in gens] == alone


def test_kv_bytes_are_the_latents():
  """At DeepSeek-V3's shapes a token's KV is 512 + 64 numbers per layer, one row for 128
  heads; grouped-query attention of 8 x 128 keys and values would hold 2048 (3.6x)."""
  c = from_hf_config(dict(
      model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
      num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
      num_experts_per_tok=8, moe_intermediate_size=2048, intermediate_size=18432,
      kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
      v_head_dim=128))
  assert c.kv_elements_per_token == 576 and c.dense_layers == (0, 1, 2)
  gqa = dataclasses.replace(c, kv_lora_rank=0, num_kv_heads=8, head_dim=128)

  def state_bytes(config):  # the decode state the engine allocates, by its shapes
    state = jax.eval_shape(lambda: init_state(config, 1, 1024, jnp.bfloat16))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.layers))

  assert state_bytes(c) == kv.state_bytes(c, 1, 1024, "bfloat16") == 61 * 1024 * 576 * 2
  assert state_bytes(gqa) / state_bytes(c) == pytest.approx(2048 / 576)  # 3.56x
