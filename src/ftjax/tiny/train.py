"""``python -m ftjax.tiny.train``: trains the embedded default model, offline.

The corpus is the Python standard library's own source (``sysconfig``'s ``stdlib`` path,
PSF licence; test directories and ``site-packages`` excluded), split into train and held-out
sets by file (a fixed hash of the path). A byte-level BPE tokenizer is trained on the train
files with ``tokenizers`` and saved as ``tokenizer.json``. The model is ftjax's own
``Transformer`` (the code the engine runs), trained in float32 with optax AdamW on
next-token cross-entropy plus the Switch load-balancing loss on each router; routed experts
run through the engine's XLA path, which for a whole sequence computes every expert over all
tokens with the router's combine weights (dense routing: exact and differentiable). The
result is written as an FTW directory in bfloat16 with the tokenizer and ``train_log.json``
(losses, baselines, timing, machine).

  python -m ftjax.tiny.train --out=/tmp/tiny                 # the shipped configuration
  python -m ftjax.tiny.train --out=/tmp/t --steps=20 --tiny  # a smoke run (seconds)

Deterministic for a given seed, Python version (the corpus) and jax version.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ftjax.experts import BankExperts
from ftjax.model.config import ModelConfig
from ftjax.model.transformer import init_state
from ftjax.runtime import model as model_lib
from ftjax.utils.progress import Progress

EOS = "<|endoftext|>"
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything that determines the trained weights (with the corpus and the seed)."""
  vocab_size: int = 4096
  hidden_size: int = 256
  num_layers: int = 6
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  num_experts: int = 32
  top_k: int = 4
  moe_intermediate_size: int = 64
  seq_len: int = 256
  batch_size: int = 16
  steps: int = 800
  learning_rate: float = 3e-3
  warmup_steps: int = 80
  weight_decay: float = 0.1
  balance_coef: float = 0.01  # Switch load-balancing loss weight, per layer
  heldout_every: int = 100  # steps between held-out evaluations
  heldout_batches: int = 8
  heldout_mod: int = 20  # a file is held out when crc32(relative path) % heldout_mod == 0

  def model_config(self) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
        num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
        head_dim=self.head_dim, num_experts=self.num_experts, top_k=self.top_k,
        moe_intermediate_size=self.moe_intermediate_size, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=4096,
        layer_types=("full_attention",) * self.num_layers, qk_norm="per_head",
        norm_topk_prob=True, tie_word_embeddings=True, source_dtype="bfloat16",
        eos_token_ids=(0,))


# A configuration small enough for the CI smoke test (seconds on 2 cores).
SMOKE = TrainConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=16, seq_len=32,
                    batch_size=4, steps=30, learning_rate=1e-2, warmup_steps=5,
                    heldout_every=10, heldout_batches=2)


# ----------------------------------------------------------------------------- corpus


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def corpus_files(root: str | None = None, heldout_mod: int = TrainConfig.heldout_mod
                 ) -> tuple[list[str], list[str]]:
  """(train, held-out) relative paths of the ``.py`` files under ``root``, sorted; a file is
  held out when the CRC-32 of its relative path is 0 mod ``heldout_mod``."""
  root = root or stdlib_root()
  if not os.path.isdir(root):
    raise FileNotFoundError(f"corpus directory {root} does not exist")
  files = []
  for d, dirs, names in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
    files.extend(os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".py"))
  files.sort()
  if not files:
    raise FileNotFoundError(f"no .py files under {root}: pass --corpus=DIR with Python sources")
  train = [f for f in files if zlib.crc32(f.encode()) % heldout_mod != 0]
  held = [f for f in files if zlib.crc32(f.encode()) % heldout_mod == 0]
  return train, held


def read_texts(root: str, files: list[str], limit_bytes: int | None = None) -> list[str]:
  texts, total = [], 0
  for f in files:
    with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
      texts.append(fh.read())
    total += len(texts[-1])
    if limit_bytes is not None and total >= limit_bytes:
      break
  return texts


def train_tokenizer(texts: list[str], vocab_size: int):
  """A byte-level BPE (``tokenizers``) with ``<|endoftext|>`` as id 0."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
  if tok.get_vocab_size() != vocab_size:
    raise ValueError(f"the corpus only supports a vocabulary of {tok.get_vocab_size()} tokens, "
                     f"fewer than the {vocab_size} asked for: use a larger corpus or vocabulary")
  return tok


def encode(tok, texts: list[str]) -> np.ndarray:
  """All texts as one token stream, each file followed by ``<|endoftext|>`` (id 0)."""
  eos = tok.token_to_id(EOS)
  out = []
  for enc in tok.encode_batch(texts):
    out.append(np.asarray(enc.ids, np.int32))
    out.append(np.asarray([eos], np.int32))
  return np.concatenate(out) if out else np.zeros((0,), np.int32)


def unigram_loss(train: np.ndarray, held: np.ndarray, vocab: int) -> float:
  """Held-out cross-entropy (nats/token) of the train split's add-one unigram distribution."""
  counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
  logp = np.log(counts / counts.sum())
  return float(-logp[held].mean())


# ----------------------------------------------------------------------------- training


def loss_fn(params, bank, graphdef, config: ModelConfig, tokens, balance_coef: float):
  """Mean next-token cross-entropy (nats) + balance_coef · Σ_layers Switch balance loss.

  tokens [B, T+1]. Returns (total, (cross-entropy, balance))."""
  model = nnx.merge(graphdef, params)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  b, t = inputs.shape
  state = init_state(config, b, t)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  experts = BankExperts(bank=bank, ffn_dim=config.moe_intermediate_size, kernels="xla")
  (_, _, logits), intermediates = nnx.capture(model, nnx.Intermediate)(
      state, inputs, positions, experts, kernels="xla", fresh=True, sow_router_logits=True)
  logp = jax.nn.log_softmax(logits, axis=-1)
  ce = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
  balance = jnp.zeros((), jnp.float32)
  router_logits_per_layer = jax.tree.leaves(intermediates)
  assert len(router_logits_per_layer) == config.num_layers, len(router_logits_per_layer)
  for router_logits in router_logits_per_layer:
    probs = jax.nn.softmax(router_logits, axis=-1)  # [B·T, E]
    _, ids = jax.lax.top_k(router_logits, config.top_k)
    chosen = jnp.sum(jax.nn.one_hot(ids, config.num_experts), axis=1)  # [B·T, E]
    frac = jnp.mean(chosen, axis=0) / config.top_k  # share of routes per expert
    balance += config.num_experts * jnp.sum(frac * jnp.mean(probs, axis=0))
  return ce + balance_coef * balance, (ce, balance)


def make_step(graphdef, config: ModelConfig, opt, balance_coef: float):

  @jax.jit
  def step(params, bank, opt_state, tokens):
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    (loss, (ce, bal)), grads = grad_fn(params, bank, graphdef, config, tokens, balance_coef)
    updates, opt_state = opt.update(grads, opt_state, (params, bank))
    params, bank = optax.apply_updates((params, bank), updates)
    return params, bank, opt_state, loss, ce, bal

  @jax.jit
  def evaluate(params, bank, tokens):
    return loss_fn(params, bank, graphdef, config, tokens, balance_coef)[1][0]

  return step, evaluate


def batches(stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator):
  """Random windows of seq_len + 1 tokens."""
  if len(stream) <= seq_len + 1:
    raise ValueError(f"the corpus has {len(stream)} tokens, too few for windows of {seq_len + 1}")
  starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
  return np.stack([stream[s:s + seq_len + 1] for s in starts])


def heldout_windows(stream: np.ndarray, n: int, seq_len: int) -> list[np.ndarray]:
  """Evenly spaced, fixed held-out windows (the same for every evaluation)."""
  if len(stream) <= seq_len + 1:
    raise ValueError(f"the held-out split has {len(stream)} tokens, too few to evaluate")
  starts = np.linspace(0, len(stream) - seq_len - 1, n, dtype=np.int64)
  return [stream[s:s + seq_len + 1] for s in starts]


def train(out_dir: str, cfg: TrainConfig = TrainConfig(), *, seed: int = 0,
          corpus: str | None = None, corpus_bytes: int | None = None, log=sys.stderr,
          progress: bool = True) -> dict:
  """Trains and writes the model to ``out_dir`` (FTW bf16 + tokenizer.json + train_log.json).
  Returns the training log. ``corpus_bytes`` caps the text read (smoke tests)."""
  t0 = time.perf_counter()
  root = corpus or stdlib_root()
  train_files, held_files = corpus_files(root, cfg.heldout_mod)
  train_texts = read_texts(root, train_files, corpus_bytes)
  held_texts = read_texts(root, held_files, None if corpus_bytes is None else corpus_bytes // 4)
  log.write(f"corpus: {root}: {len(train_texts)} train files "
            f"({sum(map(len, train_texts)) / 1e6:.1f} MB), {len(held_texts)} held-out files\n")
  tok = train_tokenizer(train_texts, cfg.vocab_size)
  train_stream, held_stream = encode(tok, train_texts), encode(tok, held_texts)
  train_bytes = sum(len(t.encode()) for t in train_texts) + len(train_texts)
  held_bytes = sum(len(t.encode()) for t in held_texts) + len(held_texts)
  unigram = unigram_loss(train_stream, held_stream, cfg.vocab_size)
  log.write(f"tokenizer: BPE {cfg.vocab_size}; train {len(train_stream)} tokens, held-out "
            f"{len(held_stream)} tokens ({held_bytes / len(held_stream):.2f} bytes/token); "
            f"unigram held-out loss {unigram:.3f} nats/token\n")

  config = cfg.model_config()
  model = model_lib.random_model(config, seed=seed, dtype="float32")
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                                cfg.steps, cfg.learning_rate * 0.05)
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
  params, bank = model.params, model.bank
  opt_state = opt.init((params, bank))
  step, evaluate = make_step(model.graphdef, config, opt, cfg.balance_coef)
  held = [jnp.asarray(w[None]) for w in heldout_windows(held_stream, cfg.heldout_batches *
                                                          cfg.batch_size, cfg.seq_len)]
  held = [jnp.concatenate(held[i:i + cfg.batch_size]) for i in range(0, len(held),
                                                                      cfg.batch_size)]

  def heldout_loss():
    return float(np.mean([float(evaluate(params, bank, w)) for w in held]))

  rng = np.random.default_rng(seed)
  history = []
  bar = Progress(cfg.steps, desc="training", enabled=progress)
  train_start = time.perf_counter()
  ce_window = []
  for i in range(1, cfg.steps + 1):
    tokens = jnp.asarray(batches(train_stream, cfg.batch_size, cfg.seq_len, rng))
    params, bank, opt_state, loss, ce, bal = step(params, bank, opt_state, tokens)
    ce_window.append(ce)
    bar.update()
    if i % cfg.heldout_every == 0 or i == cfg.steps:
      train_ce = float(np.mean([float(c) for c in ce_window]))
      ce_window = []
      h = heldout_loss()
      if not math.isfinite(h):
        raise FloatingPointError(f"held-out loss became {h} at step {i}: lower --learning_rate")
      history.append({"step": i, "train_loss": train_ce, "heldout_loss": h,
                      "balance": float(bal), "elapsed_s": time.perf_counter() - train_start})
      log.write(f"\nstep {i}: train {train_ce:.3f}, held-out {h:.3f} nats/token "
                f"(unigram {unigram:.3f}), balance {float(bal) / cfg.num_layers:.3f}\n")
  bar.close()
  train_s = time.perf_counter() - train_start
  final = history[-1]["heldout_loss"]
  result = {
      "config": dataclasses.asdict(cfg), "seed": seed, "corpus": root,
      "python": platform.python_version(), "jax": jax.__version__,
      "machine": {"processor": platform.processor() or platform.machine(),
                  "cpus": os.cpu_count(), "platform": platform.platform()},
      "train_files": len(train_texts), "heldout_files": len(held_texts),
      "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(held_stream)),
      "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
      "heldout_bytes_per_token": held_bytes / len(held_stream),
      "train_bytes_per_token": train_bytes / len(train_stream),
      "unigram_heldout_loss": unigram, "heldout_loss": final,
      "heldout_bits_per_byte": final / math.log(2) * len(held_stream) / held_bytes,
      "unigram_bits_per_byte": unigram / math.log(2) * len(held_stream) / held_bytes,
      "train_seconds": train_s, "total_seconds": time.perf_counter() - t0, "history": history,
  }
  trained = dataclasses.replace(model, params=params, bank=bank)
  source = {"kind": "trained", "trained": True, "seed": seed, "generator": "ftjax.tiny.train",
            "corpus": "Python standard library sources (PSF licence)",
            "python": platform.python_version(), "heldout_loss": final, "steps": cfg.steps}
  write_model(trained, tok, result, out_dir, source)
  return result


def write_model(model, tok, result: dict, out_dir: str, source: dict) -> str:
  """Writes FTW (bf16) + tokenizer.json + train_log.json into a temp dir, then renames."""
  parent = os.path.dirname(os.path.abspath(out_dir)) or "."
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".ftjax-train-", dir=parent)
  os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is a normal directory
  try:
    model_lib.save(model, tmp, dtype="bfloat16", source=source)
    tok.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "train_log.json"), "w") as f:
      json.dump(result, f, indent=1)
    if os.path.exists(out_dir):
      if not os.path.isfile(os.path.join(out_dir, "ftw.json")):
        raise FileExistsError(f"{out_dir} exists and is not an FTW directory; refusing to "
                              "replace it: choose another --out")
      shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def main(argv):
  from absl import app  # noqa: PLC0415
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  cfg = SMOKE if _TINY.value else TrainConfig()
  overrides = {k: v for k, v in (("steps", _STEPS.value),) if v is not None}
  cfg = dataclasses.replace(cfg, **overrides)
  try:
    result = train(_OUT.value, cfg, seed=_SEED.value, corpus=_CORPUS.value)
  except (ValueError, FileNotFoundError, FileExistsError) as e:
    raise SystemExit(f"ftjax.tiny.train: error: {e}") from None
  print(f"held-out loss {result['heldout_loss']:.3f} nats/token "
        f"({result['heldout_bits_per_byte']:.3f} bits/byte; unigram "
        f"{result['unigram_heldout_loss']:.3f}) after {result['train_seconds'] / 60:.1f} min; "
        f"wrote {_OUT.value}")


if __name__ == "__main__":
  from absl import app, flags
  _OUT = flags.DEFINE_string("out", None, "output directory (FTW)", required=True)
  _STEPS = flags.DEFINE_integer("steps", None, "training steps (default: the config's)",
                                lower_bound=1)
  _SEED = flags.DEFINE_integer("seed", 0, "seed for init and batch order")
  _CORPUS = flags.DEFINE_string("corpus", None, "directory of .py files (default: the stdlib)")
  _TINY = flags.DEFINE_bool("tiny", False, "the smoke-test configuration (seconds)")
  app.run(main)
