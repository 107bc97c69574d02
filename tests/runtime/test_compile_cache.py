"""The persistent compilation cache of ftjax's commands: a second run of the same command
compiles nothing new; ``--nocompilation_cache`` writes nothing; the cache is kept per ftjax
build, beside the converted weights in ``FTJAX_CACHE_DIR``."""

import os
import subprocess
import sys

import ftjax
from ftjax.runtime import compile_cache


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
