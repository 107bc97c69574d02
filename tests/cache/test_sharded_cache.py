"""Expert-parallel slots (``devices=``) on 4 CPU devices give the one-device result over a
prefill and 8 greedy steps: same tokens, logits within float32 tolerance, the same cache
tables, and the slot buffer really split over the devices. ``freetoken`` and ``lru_fill`` at
sizes 0, 1, L·E/3 and L·E, an LRFU-scored and a preloaded policy at L·E/3 (the sharded fill
and serve paths do not depend on the policy, whose plan every device computes alike; CI time).

JAX fixes its CPU device count at start-up, so the check runs in a child process started with
``JAX_NUM_CPU_DEVICES=4``; it prints one JSON line per case for the assertions here."""

import json
import os
import subprocess
import sys
import textwrap

import pytest


CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    import ftjax
    from ftjax.cache.state import check_invariants
    from ftjax.model.config import ModelConfig
    from ftjax.runtime.model import random_model
    assert len(jax.devices()) == 4, jax.devices()
    config = ModelConfig(
        model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, num_experts=8, top_k=2, moe_intermediate_size=16,
        rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
        layer_types=("full_attention",) * 2, qk_norm="per_head", norm_topk_prob=True)
    model = random_model(config, seed=3)
    model = model.__class__(**{**{f: getattr(model, f) for f in model.__dataclass_fields__},
                               "params": jax.tree.map(lambda x: 8.0 * x, model.params)})
    total = config.num_layers * config.num_experts
    prompt = [3, 14, 15, 9, 2]

    def logits(engine):
        state = engine.new_state(1, 32)
        out = []
        state, lg = engine.step(state, jnp.asarray([prompt], jnp.int32),
                                jnp.arange(5, dtype=jnp.int32)[None], last_only=True)
        out.append(np.asarray(lg[0, -1]))
        for i in range(8):
            token = np.int32(out[-1].argmax())
            state, lg = engine.step(state, jnp.full((1, 1), token, jnp.int32),
                                    jnp.full((1, 1), 5 + i, jnp.int32), last_only=True)
            out.append(np.asarray(lg[0, -1]))
        return np.stack(out)

    for kernels in sys.argv[1].split(","):
        for policy in ("freetoken", "lru_fill", "freetoken_lrfu_cycle", "static_hot"):
            sizes = (0, 1, total // 3, total) if policy in ("freetoken", "lru_fill") else (
                total // 3,)
            for slots in sizes:
                opts = dict(kernels=kernels, cache_slots=slots, policy=policy,
                            bandwidths=(12.0, 24.0), hot_experts=np.arange(total)[::-1],
                            cache_capacity=total)
                one, four = ftjax.Engine(model, **opts), ftjax.Engine(model, devices=4, **opts)
                a, b = logits(one), logits(four)
                check_invariants(four.cache)
                tables = all(np.array_equal(np.asarray(getattr(one.cache, f)),
                                            np.asarray(getattr(four.cache, f)))
                             for f in ("owner", "slot_of", "slot_stamp", "expert_stamp"))
                slots_equal = np.array_equal(np.asarray(one.cache.slots),
                                             np.asarray(four.cache.slots))
                print(json.dumps({
                    "kernels": kernels, "policy": policy, "slots": slots,
                    "tokens_equal": bool((a.argmax(-1) == b.argmax(-1)).all()),
                    "tables_equal": bool(tables),
                    "slots_equal": bool(slots_equal),
                    "logit_error": float(np.abs(a - b).max() / max(1.0, np.abs(a).max())),
                    "slot_devices": len(four.cache.slots.sharding.device_set),
                    "spec": str(four.cache.slots.sharding.spec)}), flush=True)
    # The device loop (prefill program, then decode chunks) on the mesh, with the pool in
    # device memory and in pinned_host memory (fills as slices on every device).
    loops = {}
    for pool in ("device", "pinned_host"):
        for slots in (total // 3,):
            opts = dict(cache_slots=slots, policy="freetoken", bandwidths=(12.0, 24.0))
            loops[f"{pool}/{slots}"] = [
                ftjax.Engine(model, **opts).generate(prompt, 12),
                ftjax.Engine(model, devices=4, pool=pool, **opts).generate(prompt, 12)]
    # The GPU program on the mesh (copy-kernel fills and host experts inside the shard_map)
    # exports for CUDA.
    import dataclasses
    from jax import export
    from jax.sharding import NamedSharding, PartitionSpec
    from ftjax.cache.moe import Offload
    from ftjax.kernels import cuda
    from ftjax.runtime import programs
    from ftjax.runtime.sampling import Sampling
    bf16 = random_model(config, seed=0, dtype="bfloat16")
    engine = ftjax.Engine(bf16, kernels="xla", cache_slots=5, policy="freetoken",
                          bandwidths=(12.0, 24.0), devices=4)
    pool = cuda.PoolSpec(handle=0, shape=tuple(bf16.bank.shape), dtype="bfloat16")
    runner = dataclasses.replace(engine.runner, offload=Offload(fill="cuda", host="cuda",
                                                                pool=pool, mesh=engine.mesh))
    rep = NamedSharding(engine.mesh, PartitionSpec())
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", rep))
    state = engine.new_state(1, 256)
    state = state.replace(length=state.length.reshape(1))  # a decode batch of one row
    exported = export.export(
        jax.jit(lambda *a: programs.decode_program(runner, *a)), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(t) for t in cuda.TARGETS])(
        jax.tree.map(spec, engine.params), None,
        jax.tree.map(spec, engine.executor.engine_state(state)),
        *engine.executor.decode_specs(1))  # replicated over the engine's mesh
    text = exported.mlir_module()
    print(json.dumps({"generate": loops, "export": [
        exported.nr_devices, text.count("ftjax_cuda_host_experts_start"),
        text.count("ftjax_cuda_pool_fill")]}))
""")


@pytest.fixture(scope="module")
def cases():
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="4", JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", CHILD, "ffi"], capture_output=True, text=True,
                        env=env, timeout=900, check=False)
  assert done.returncode == 0, done.stderr[-4000:]
  return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_four_devices_equal_one(cases):
  *cases, last = cases
  assert len(cases) == 2 * 4 + 2
  assert len(last["generate"]) == 2
  for name, (one, four) in last["generate"].items():
    assert one == four and len(one) == 12, name
  # 4 devices; one start/done pair and one fill per MoE layer in the shard_map's body.
  assert last["export"] == [4, 2, 2]
  for case in cases:
    assert case["tokens_equal"] and case["tables_equal"] and case["slots_equal"], case
    assert case["logit_error"] <= 1e-5, case
    assert case["slot_devices"] == 4 and "'experts'" in case["spec"], case


def test_devices_errors_are_clear(tiny_config):
  import ftjax  # noqa: PLC0415
  from ftjax.runtime import model as model_lib  # noqa: PLC0415
  model = model_lib.random_model(tiny_config, seed=0)
  for devices in (0, 64, 2.0):
    with pytest.raises(ValueError, match="devices must be an int in"):
      ftjax.Engine(model, cache_slots=2, policy="lru_fill", devices=devices)
