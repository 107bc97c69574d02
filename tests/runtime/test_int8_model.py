"""The trained default model with int8 experts (docs/ftw.md), quantised through FTW (save with
expert_format="int8", then load): its held-out loss moves by at most 0.5% and at least 98% of
the bfloat16 model's top-1 predictions stay; ``python -m ftjax.decode`` runs it unchanged.

Measured (AMD EPYC, avx512bf16, kernels="ffi", four 384-token windows): held-out loss
3.7216 (bf16 experts) -> 3.7214 (int8), -0.01%; top-1 agreement 99.74%.
"""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ftjax
from ftjax.runtime import model as model_lib

from reference import mean_nll


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
  """The default model, its int8-expert FTW copy, and four 384-token held-out windows."""
  from ftjax.runtime.tokenizer import load_tokenizer  # noqa: PLC0415
  from ftjax.tiny import train  # noqa: PLC0415
  default = ftjax.load("default")
  path = model_lib.save(default, tmp_path_factory.mktemp("int8") / "m", expert_format="int8")
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(default.path, name), path)
  int8 = ftjax.load(path)
  tok = load_tokenizer(default.path, default.config.vocab_size)
  root = train.stdlib_root()
  _, held = train.corpus_files(root)
  stream = tok.encode("\n".join(train.read_texts(root, held, limit_bytes=40_000)))
  assert len(stream) >= 3000
  return default, int8, [stream[s:s + 384] for s in (0, 700, 1400, 2100)]


def _compare(reference_engine, engine, windows, what):
  """(held-out loss of the reference, of the engine, top-1 agreement), means over windows."""
  before, after, agree = [], [], []
  for ids in windows:
    reference, got = reference_engine.forward_logits(ids), engine.forward_logits(ids)
    before.append(mean_nll(reference, ids))
    after.append(mean_nll(got, ids))
    agree.append(np.mean(got.argmax(-1) == reference.argmax(-1)))
  before, after, agreement = np.mean(before), np.mean(after), np.mean(agree)
  print(f"{what}: held-out loss {before:.4f} -> {after:.4f} ({(after / before - 1) * 100:+.2f}%), "
        f"top-1 agreement {agreement * 100:.2f}%")
  return before, after, agreement


def test_int8_experts_keep_the_heldout_loss_and_predictions(heldout):
  default, int8, windows = heldout
  assert default.expert_format == "bfloat16" and int8.expert_format == "int8"
  assert int8.dtype == default.dtype  # dense weights untouched
  before, after, agreement = _compare(ftjax.Engine(default, kernels="ffi"),
                                      ftjax.Engine(int8, kernels="ffi"), windows, "int8 experts")
  assert after != before  # the experts really are quantised
  assert abs(after - before) <= 0.005 * before
  assert agreement >= 0.98


def test_int8_activations_opt_in_quality(heldout):
  """kernels="ffi_int8" (opt-in; AVX-512-VNNI): the experts' activations quantised to int8 too.
  Held-out loss within 1% of the exact int8 model's, top-1 agreement >= 95%. Measured (AMD
  EPYC, avx512bf16): loss 3.7214 -> 3.7212 (-0.01%), top-1 agreement 98.89%."""
  from ftjax.kernels import cpu_info  # noqa: PLC0415
  _, int8, windows = heldout
  if cpu_info()["isa"] != "avx512bf16":
    with pytest.raises(Exception, match="int8_activations needs AVX-512-VNNI"):
      ftjax.Engine(int8, kernels="ffi_int8").forward_logits(windows[0])
    pytest.skip(f"no AVX-512-VNNI kernels here ({cpu_info()['isa']}): the error was checked")
  before, after, agreement = _compare(ftjax.Engine(int8, kernels="ffi"),
                                      ftjax.Engine(int8, kernels="ffi_int8"), windows,
                                      "int8 activations")
  assert after != before
  assert abs(after - before) <= 0.01 * before
  assert agreement >= 0.95


def test_ffi_int8_needs_int8_experts(heldout):
  default, _, _ = heldout
  with pytest.raises(ValueError, match="kernels='ffi_int8' quantises the activations of int8"):
    ftjax.Engine(default, kernels="ffi_int8")


def test_decode_cli_runs_the_int8_model_with_a_cache(heldout, tmp_path):
  _, int8, _ = heldout
  proc = subprocess.run(
      [sys.executable, "-m", "ftjax.decode", f"--model={int8.path}", "--max_new_tokens=8",
       "--greedy", "--cache_slots=40", "--policy=lru_fill", "--stats"],
      capture_output=True, text=True, check=False, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("def fibonacci(n):")
  summary = [line for line in proc.stderr.splitlines() if line.startswith("prompt tokens:")][-1]
  assert re.search(r"new tokens: 8,.*, kernels: ffi \(", summary), summary  # exact int8 kernel
