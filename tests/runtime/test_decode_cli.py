"""``python -m ftjax.decode`` and the embedded default model."""

import filecmp
import io
import json
import os
import subprocess
import sys

import pytest

import ftjax
from ftjax.formats import ftw
from ftjax.runtime.decode import run_decode
from ftjax.tiny import DEFAULT_MODEL_DIR, random_default


def _run(*flags, cwd):
  return subprocess.run([sys.executable, "-m", "ftjax.decode", *flags], capture_output=True,
                        text=True, check=False, cwd=cwd)


def test_no_flags_runs_the_embedded_default_model(tmp_path):
  proc = _run("--max_new_tokens=8", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("def fibonacci(n):")
  assert "random-initialised and untrained" in proc.stderr
  summary = proc.stderr.strip().splitlines()[-1]
  assert summary.startswith("prompt tokens: 17, new tokens: 8, prefill:") and "decode:" in summary


@pytest.mark.parametrize("flag, message", [
    ("--top_p=1.5", "top_p must be in (0, 1]"),
    ("--temperature=-1", "temperature must be > 0"),
    ("--max_new_tokens=5000", "exceeds the context of 2048 tokens"),
    ("--model=/nonexistent/model", "does not exist"),
])
def test_bad_flags_are_clear_errors(tmp_path, flag, message):
  proc = _run(flag, cwd=tmp_path)
  assert proc.returncode != 0
  assert message in proc.stderr and "Traceback" not in proc.stderr
  assert proc.stdout == ""  # nothing printed before the error


def test_shipped_default_model_is_what_the_generator_makes(tmp_path):
  f = ftw.FTWFile.open(DEFAULT_MODEL_DIR)  # verifies every checksum
  assert f.index["source"]["kind"] == "random-init" and f.dtype.name == "bfloat16"
  rebuilt = random_default.build(str(tmp_path / "rebuilt"))
  for name in (ftw.INDEX_NAME, ftw.DENSE_FILE, ftw.EXPERTS_FILE):
    assert filecmp.cmp(os.path.join(DEFAULT_MODEL_DIR, name), os.path.join(rebuilt, name),
                       shallow=False), name


def test_default_model_greedy_output_is_deterministic():
  runs = [run_decode(prompt="def add(a, b):", max_new_tokens=12, greedy=True, out=io.StringIO(),
                     log=io.StringIO()) for _ in range(2)]
  assert runs[0].generation.tokens == runs[1].generation.tokens
  assert len(runs[0].generation.tokens) == 12 and runs[0].tokenizer == "bytes"


def test_default_model_cached_decode_equals_full_forward():
  model = ftjax.load(DEFAULT_MODEL_DIR)
  engine = ftjax.Engine(model, kernels="ffi")  # exact: bf16 activations could flip near-ties
  prompt = list(b"import os\n")
  new = engine.generate(prompt, 10, greedy=True)
  full = engine.forward_logits(prompt + new)
  assert [int(t) for t in full[len(prompt) - 1:-1].argmax(-1)] == new


def test_hf_dir_with_tokenizer_json(hf_checkpoints, tmp_path, monkeypatch):
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
  monkeypatch.setenv("FTJAX_CACHE_DIR", str(tmp_path / "cache"))
  _, src = hf_checkpoints["olmoe"]
  dst = tmp_path / "hf"
  os.makedirs(dst)
  for name in os.listdir(src):
    os.symlink(os.path.join(src, name), dst / name)
  vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", "foo", "bar"])}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(dst / "tokenizer.json"))
  out = io.StringIO()
  result = run_decode(str(dst), "hello world", max_new_tokens=5, greedy=True, out=out,
                      log=io.StringIO())
  assert result.tokenizer == "tokenizer.json" and result.generation.prompt_tokens == 2
  assert len(result.generation.tokens) == 5
  assert os.path.isfile(os.path.join(result.model_path, "tokenizer.json"))


def test_trace_out_writes_a_routing_trace(tmp_path):
  from ftjax.traces import Trace  # noqa: PLC0415
  path = tmp_path / "trace.npz"
  proc = _run("--max_new_tokens=6", "--greedy", f"--trace_out={path}", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  trace = Trace.load(path)
  assert trace.num_steps == 17 + 5 and trace.num_layers == 4 and trace.num_experts == 16
  assert trace.phase.tolist() == [0] * 17 + [1] * 5
