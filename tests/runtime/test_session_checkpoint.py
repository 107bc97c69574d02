"""Session checkpoints (orbax): a restore in a new process continues bit-identically, a save
killed mid-way leaves the previous step restorable, and a missing, unfinished, corrupt or
foreign checkpoint is a clear error."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ftjax
from ftjax.runtime.tokenizer import load_tokenizer

CHAT = ("<|im_start|>user\nsort a list<|im_end|>\n<|im_start|>assistant\n<think>\nsorted"
        "</think>\n\nUse sorted(x).<|im_end|>\n<|im_start|>user\nreversed?<|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def engine():
  return ftjax.Engine(ftjax.load("default-hybrid"), kernels="ffi")


def _run(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                        text=True, timeout=300)


def test_restore_in_a_new_process_is_bit_identical(engine, tmp_path):
  tok = load_tokenizer(engine.model.path, engine.model.config.vocab_size)
  session = ftjax.Session(engine)
  session.set_context(tok.encode(CHAT))
  session.generate(6)
  assert session.save(tmp_path / "ckpt") == 0
  saved_stats = session.stats()
  # The never-saved session's next steps.
  ref = session.set_context(session.tokens + [7]).last_logits
  ref_tokens = session.generate(6)
  np.save(tmp_path / "ref.npy", ref)
  out = _run(f"""
      import json, numpy as np, ftjax
      engine = ftjax.Engine(ftjax.load("default-hybrid"), kernels="ffi")
      session = ftjax.Session.restore(engine, {str(tmp_path / "ckpt")!r})
      stats = session.stats()
      r = session.set_context(session.tokens + [7])
      np.save({str(tmp_path / "got.npy")!r}, r.last_logits)
      print(json.dumps({{"tokens": session.generate(6), "anchors": stats["anchor_list"],
                        "turns": stats["turns"]}}))
      """)
  assert out.returncode == 0, out.stderr[-3000:]
  got = __import__("json").loads(out.stdout.strip().splitlines()[-1])
  assert np.array_equal(np.load(tmp_path / "got.npy"), ref)  # bit-identical
  assert got["tokens"] == ref_tokens
  assert got["anchors"] == saved_stats["anchor_list"]
  assert got["turns"] == saved_stats["turns"]


def test_a_save_killed_midway_leaves_the_previous_step(engine, tmp_path):
  tok = load_tokenizer(engine.model.path, engine.model.config.vocab_size)
  ckpt = tmp_path / "ckpt"
  out = _run(f"""
      import os, ftjax
      from orbax.checkpoint._src.path import atomicity
      from ftjax.runtime.tokenizer import load_tokenizer
      engine = ftjax.Engine(ftjax.load("default-hybrid"), kernels="ffi")
      tok = load_tokenizer(engine.model.path, engine.model.config.vocab_size)
      session = ftjax.Session(engine)
      session.set_context(tok.encode({CHAT!r}))
      session.save({str(ckpt)!r})  # step 0, complete
      session.set_context(session.tokens + [9, 10, 11])
      def die(*args, **kwargs):  # killed once step 1 is written, before its commit (rename)
        os._exit(17)
      atomicity.AtomicRenameTemporaryPath.finalize = die
      session.save({str(ckpt)!r})
      """)
  assert out.returncode == 17, out.stderr[-3000:]
  leftovers = [n for n in os.listdir(ckpt) if n not in ("0",)]
  assert leftovers and all("tmp" in n for n in leftovers), os.listdir(ckpt)  # step 1 unfinished
  restored = ftjax.Session.restore(engine, ckpt)
  assert restored.tokens == tok.encode(CHAT)
  fresh = engine.forward_logits(restored.tokens + [3])[-1]
  got = restored.set_context(restored.tokens + [3]).last_logits
  np.testing.assert_allclose(got, fresh, rtol=0, atol=1e-5 * max(1.0, np.abs(fresh).max()))


def test_bad_checkpoints_are_clear_errors(engine, tmp_path):
  session = ftjax.Session(engine)
  with pytest.raises(ValueError, match="no context to save"):
    session.save(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    ftjax.Session.restore(engine, tmp_path / "nowhere")
  (tmp_path / "none").mkdir()
  with pytest.raises(ftjax.CheckpointError, match="no complete session checkpoint"):
    ftjax.Session.restore(engine, tmp_path / "none")

  session.set_context([1, 2, 3, 4088, 5, 6])
  session.save(tmp_path / "ok")
  other = ftjax.Engine(ftjax.load("default"), kernels="ffi")
  with pytest.raises(ftjax.CheckpointError, match="saved from another model"):
    ftjax.Session.restore(other, tmp_path / "ok")

  # Damage every array data file: a CRC mismatch or an unreadable file, never a wrong state.
  data = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "ok" / "0" / "arrays")
          for f in files if os.sep + "d" + os.sep in os.path.join(d, f) + os.sep]
  assert data
  for path in data:
    raw = bytearray(open(path, "rb").read())
    for i in range(0, len(raw), 7):
      raw[i] ^= 0x5A
    open(path, "wb").write(bytes(raw))
  # Restored in a subprocess: after failing to read damaged files, orbax leaves callbacks for
  # its closed event loop, which would surface as "unraisable" warnings in later tests.
  out = _run(f"""
      import ftjax
      engine = ftjax.Engine(ftjax.load("default-hybrid"), kernels="ffi")
      try:
        ftjax.Session.restore(engine, {str(tmp_path / "ok")!r})
      except ftjax.CheckpointError as e:
        print("CheckpointError:", e)
      """)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "CheckpointError:" in out.stdout and "corrupt" in out.stdout, out.stdout


def test_async_save_and_anchor_budget_on_restore(engine, tmp_path):
  tok = load_tokenizer(engine.model.path, engine.model.config.vocab_size)
  session = ftjax.Session(engine)
  session.set_context(tok.encode(CHAT))
  held = session.stats()["anchors"]
  assert held >= 3
  session.save(tmp_path / "a", wait=False)
  session.set_context(session.tokens + [1, 2])  # the state moves on while the save runs
  session.wait_for_saves()
  small = ftjax.Session.restore(engine, tmp_path / "a", anchor_budget_bytes=session.anchor_bytes)
  assert small.stats()["anchors"] == 1
  assert small.tokens == tok.encode(CHAT)
  none = ftjax.Session.restore(engine, tmp_path / "a", anchor_budget_bytes=0)
  assert none.stats()["anchors"] == 0 and not none.anchoring
  ref = engine.forward_logits(tok.encode(CHAT))[-1]
  assert np.array_equal(none.set_context(tok.encode(CHAT)).last_logits,
                        small.set_context(tok.encode(CHAT)).last_logits)
  np.testing.assert_allclose(none.set_context(tok.encode(CHAT)).last_logits, ref, rtol=0,
                             atol=1e-5 * max(1.0, np.abs(ref).max()))
