"""The training loop of the embedded default model (CI never trains the real one): a few
steps of the smoke configuration on a slice of the stdlib corpus lower the loss, are
deterministic, and write a model that ftjax loads and runs with its tokenizer."""

import io
import json
import os

import numpy as np
import pytest

import ftjax
from ftjax.decode import run_decode
from ftjax.tiny import train


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("smoke") / "model")
  log = io.StringIO()
  result = train.train(out, train.SMOKE, seed=0, corpus_bytes=200_000, log=log, progress=False)
  return out, result, log.getvalue()


def test_loss_decreases_and_beats_nothing_trivial(smoke):
  _, result, log = smoke
  history = result["history"]
  assert len(history) == train.SMOKE.steps // train.SMOKE.heldout_every
  # Initial loss of a uniform predictor is ln(V); training must be well below it, and the
  # held-out loss must fall from the first evaluation to the last.
  assert history[0]["train_loss"] < np.log(train.SMOKE.vocab_size) + 0.1
  assert history[-1]["heldout_loss"] < history[0]["heldout_loss"] - 0.2
  assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.2
  assert "held-out" in log and "unigram" in log


def test_writes_a_loadable_model_with_its_tokenizer(smoke):
  out, result, _ = smoke
  assert sorted(os.listdir(out)) == ["dense.bin", "experts.bin", "ftw.json", "tokenizer.json",
                                     "train_log.json"]
  model = ftjax.load(out)  # verifies the checksums
  assert model.config == train.SMOKE.model_config()
  assert model.source["trained"] and model.dtype == np.dtype("bfloat16")
  with open(os.path.join(out, "train_log.json")) as f:
    assert json.load(f)["heldout_loss"] == result["heldout_loss"]
  r = run_decode(out, "def f(x):", max_new_tokens=6, greedy=True, out=io.StringIO(),
                 log=io.StringIO())
  assert r.tokenizer == "tokenizer.json" and len(r.generation.tokens) == 6


def test_deterministic_for_a_seed(smoke, tmp_path):
  cfg = train.SMOKE
  short = type(cfg)(**{**cfg.__dict__, "steps": 10, "heldout_every": 10})
  a = train.train(str(tmp_path / "a"), short, seed=0, corpus_bytes=200_000, log=io.StringIO(),
                  progress=False)
  b = train.train(str(tmp_path / "b"), short, seed=0, corpus_bytes=200_000, log=io.StringIO(),
                  progress=False)
  assert a["history"][-1]["heldout_loss"] == b["history"][-1]["heldout_loss"]
  for name in ("dense.bin", "experts.bin", "tokenizer.json"):
    with open(tmp_path / "a" / name, "rb") as fa, open(tmp_path / "b" / name, "rb") as fb:
      assert fa.read() == fb.read(), name


def test_held_out_split_is_by_file_and_disjoint():
  train_files, held = train.corpus_files()
  assert held and train_files and not set(held) & set(train_files)
  assert all(f.endswith(".py") for f in train_files + held)
  assert not any(part in ("test", "tests", "site-packages")
                 for f in train_files + held for part in f.split(os.sep))


def test_refuses_to_replace_a_directory_that_is_not_a_model(tmp_path):
  (tmp_path / "notes.txt").write_text("keep me")
  with pytest.raises(FileExistsError, match="refusing to replace"):
    train.train(str(tmp_path), train.SMOKE, corpus_bytes=50_000, log=io.StringIO(),
                progress=False)
  assert (tmp_path / "notes.txt").read_text() == "keep me"
