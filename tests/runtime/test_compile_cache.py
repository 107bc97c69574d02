"""The persistent compilation cache of ftjax's commands: a second run of the same command
compiles nothing new; ``--nocompilation_cache`` writes nothing; the cache is kept per ftjax
build, beside the converted weights in ``FTJAX_CACHE_DIR``."""

import json
import os
import re
import subprocess
import sys

import jax
import pytest

import ftjax
from ftjax.runtime import compile_cache, programs
from ftjax.runtime import model as model_lib


def _decode(cache_root, *flags):
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["FTJAX_CACHE_DIR"] = str(cache_root)
  return subprocess.run([sys.executable, "-m", "ftjax.decode", "--max_new_tokens=12", *flags],
                        capture_output=True, text=True, env=env, timeout=300, check=False)


def _entries(path):
  return sorted(os.listdir(path)) if os.path.isdir(path) else []


def test_a_second_run_compiles_nothing_new(tmp_path):
  where = tmp_path / "xla" / compile_cache.build_key()
  first = _decode(tmp_path)
  assert first.returncode == 0, first.stderr
  assert f"compilation cache: {where}" in first.stderr
  entries = _entries(where)
  assert len(entries) >= 2  # the prefill and the decode programs, at least
  second = _decode(tmp_path)
  assert second.returncode == 0, second.stderr
  assert second.stdout == first.stdout
  assert _entries(where) == entries  # every program came from the cache


def test_the_cache_can_be_turned_off(tmp_path):
  off = _decode(tmp_path, "--nocompilation_cache")
  assert off.returncode == 0, off.stderr
  assert "compilation cache: off (--nocompilation_cache)" in off.stderr
  assert not (tmp_path / "xla").exists()


def test_the_key_follows_the_build():
  key = compile_cache.build_key()
  assert key.startswith(f"ftjax-{ftjax.__version__}-") and len(key) > 20
  assert compile_cache.build_key() == key  # stable for one build and machine
  identity = compile_cache.cpu_identity()
  assert "flags" in identity and "model name" in identity  # keyed by the CPU's ISA too


def test_the_key_follows_the_cpus_the_process_may_use():
  """XLA:CPU partitions fusions for the threads it finds when it compiles: a process pinned to
  one CPU must not hand its executables to one that has two."""
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs 2 CPUs")
  code = "from ftjax.runtime import compile_cache; print(compile_cache.build_key())"
  one = subprocess.run(["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable,
                        "-c", code], capture_output=True, text=True, check=True, cwd="/")
  assert one.stdout.strip() != compile_cache.build_key()
  assert one.stdout.strip().startswith(f"ftjax-{ftjax.__version__}-")


# -- Whole executables: a warm start loads its programs without tracing them ---------------------

def test_a_warm_run_loads_its_programs_untraced(tmp_path):
  first = _decode(tmp_path)
  assert first.returncode == 0, first.stderr
  store = tmp_path / "executables" / compile_cache.build_key()
  assert f"executables: {store}" in first.stderr
  assert "loaded untraced" not in first.stderr  # nothing stored yet: every program compiled
  files = sorted(p.name for p in store.rglob("*.exe"))
  assert len(files) >= 2
  second = _decode(tmp_path)
  assert second.returncode == 0, second.stderr
  assert second.stdout == first.stdout  # the same tokens
  made = re.search(r"(\d+) of (\d+) programs loaded untraced", second.stderr)
  assert made is not None and made.group(1) == made.group(2), second.stderr
  assert sorted(p.name for p in store.rglob("*.exe")) == files


def test_a_damaged_executable_is_removed_and_compiled_again(tmp_path):
  first = _decode(tmp_path)
  assert first.returncode == 0, first.stderr
  store = tmp_path / "executables" / compile_cache.build_key()
  damaged = sorted(store.rglob("*.exe"))
  for i, path in enumerate(damaged):  # one truncated, the others garbage
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if i == 0 else b"not an executable")
  second = _decode(tmp_path)
  assert second.returncode == 0, second.stderr
  assert second.stdout == first.stdout
  assert "did not load" in second.stderr and "removed, compiling instead" in second.stderr
  assert "loaded untraced" not in second.stderr
  assert not list(store.rglob("*.exe"))  # none is used again
  # JAX's own cache served the compiles: those executables are not stored (they would not
  # serialize whole), and that is said; the next run traces them again, and is right.
  assert "cannot be stored again whole" in second.stderr
  third = _decode(tmp_path)
  assert third.returncode == 0 and third.stdout == first.stdout
  assert "did not load" not in third.stderr and "loaded untraced" not in third.stderr


_KEYED = """
import json, sys
import ftjax
from ftjax.runtime import compile_cache
compile_cache.enable_executables(sys.argv[1])
model = ftjax.load("default")
out = {}
for name, options in [("a", {}), ("xla", {"kernels": "xla"}), ("long", {"max_seq_len": 256})]:
  engine = ftjax.Engine(model, **{"max_seq_len": 64, **options})
  tokens = engine.generate([5, 17, 3, 99], 6, greedy=True)
  out[name] = [tokens, engine.compile_count, engine.loaded_count]
print(json.dumps(out))
"""


def test_stored_programs_are_keyed_by_what_they_depend_on(tmp_path):
  """Without JAX's persistent cache (none in the environment), in fresh processes: a second
  process loads every program it stored; another runner (kernels) or another argument shape
  (a KV capacity) is another program, compiled; the tokens are the same either way."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}

  def run(*args):
    done = subprocess.run([sys.executable, "-c", _KEYED, *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])

  first = run(tmp_path / "one")
  assert first["a"][2] == first["xla"][2] == 0 and first["xla"][1] >= 2, first
  # The longer KV's runner is the first engine's: its first-token program (no KV in its
  # arguments) comes from the store, its prefill and decode programs are compiled.
  assert 0 < first["long"][1] - first["long"][2] < first["long"][1], first
  second = run(tmp_path / "one")
  assert all(loaded == made for _, made, loaded in second.values()), second
  assert {k: v[0] for k, v in second.items()} == {k: v[0] for k, v in first.items()}
  assert first["a"][0] == first["long"][0]  # the capacity changes the programs, not tokens
  store = tmp_path / "one"
  assert len(list(store.rglob("*.exe"))) == sum(v[1] - v[2] for v in first.values())


def test_a_program_without_a_stable_description_is_not_stored(tmp_path, capsys):
  model = ftjax.load("default")
  engine = ftjax.Engine(model, max_seq_len=64)
  runner = engine.executor.table.runner
  compile_cache.enable_executables(str(tmp_path))
  try:
    kind = programs.ProgramKind("odd", lambda runner: runner)
    assert compile_cache.fingerprint(kind, runner, (), {}) is None
    assert "compiled, not stored" in capsys.readouterr().err
    extend = programs.EXTEND
    one = (jax.ShapeDtypeStruct((1, 16), "int32"),)
    a = compile_cache.fingerprint(extend, runner, one, {})
    b = compile_cache.fingerprint(extend, runner, one, {})
    c = compile_cache.fingerprint(extend, runner, (jax.ShapeDtypeStruct((1, 32), "int32"),), {})
    d = compile_cache.fingerprint(extend, runner, one, {"capacity": 64})
    e = compile_cache.fingerprint(programs.DECODE, runner, one, {})
    assert a == b and len({a, c, d, e}) == 4
  finally:
    compile_cache.disable_executables()
  assert compile_cache.fingerprint(programs.EXTEND, runner, one, {}) is None  # store off


def test_programs_are_compiled_without_ynn_fusions(tiny_config):
  """XLA:CPU's YNNPACK fusions made a loaded executable far slower than the same program
  just compiled (the server's 4-row decode program: 128 tokens in ~4.3 s warm against ~0.15 s
  fresh): ftjax's programs are compiled without them (``compile_cache.compiler_options``),
  the engine's batch decode program included."""
  import numpy as np  # noqa: PLC0415

  def f(x, w):
    return jax.nn.silu(x @ w) * 2.0 + x.sum()

  x, w = np.ones((4, 256), np.float32), np.ones((256, 256), np.float32)
  ours = compile_cache.compile_program(jax.jit(f).lower(x, w), None).as_text()
  assert "%ynn_fusion" not in ours
  if jax.default_backend() == "cpu":
    assert compile_cache.compiler_options() == {"xla_cpu_experimental_ynn_fusion_type": ""}
  engine = ftjax.Engine(model_lib.random_model(tiny_config, seed=0), decode_chunk=4)
  key = engine.executor.key("decode", batch=4, capacity=engine.kv_capacities[0],
                            stop_width=8)
  program = engine.executor.program(key)
  assert "%ynn_fusion" not in program.as_text()
