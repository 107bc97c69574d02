"""``python -m ftjax.tiny.train``: trains the embedded default models, offline.

Two architectures (``--arch``): ``moe``, the ``qwen3_moe`` default model (every layer full
attention), and ``hybrid``, a ``qwen3_5_moe``-style model (three Gated DeltaNet layers, then
one gated full-attention layer with partial rotary, repeated; zero-centred norms; a
sigmoid-gated shared expert beside the routed ones).

The corpus is the Python standard library's own source (``sysconfig``'s ``stdlib`` path,
PSF licence; test directories and ``site-packages`` excluded), split into train and held-out
sets by file (a fixed hash of the path). A byte-level BPE tokenizer is trained on the train
files with ``tokenizers`` and saved as ``tokenizer.json``; the last ids of its vocabulary
are Qwen's chat tokens (``CHAT_TOKENS``), and ``tokenizer_config.json`` carries a Qwen3-style
chat template (``chat_template.jinja``). The model is ftjax's own ``Transformer`` (the code
the engine runs), trained in float32 with optax AdamW on next-token cross-entropy plus the
Switch load-balancing loss on each router; routed experts run through the engine's XLA
path, which for a whole sequence computes every expert over all tokens with the router's
combine weights (dense routing: exact and differentiable). At each held-out evaluation the
routing of held-out code is measured with ``ftjax.research.routing_stats`` (consecutive-token
expert overlap, LRU hit rates, skew). The result is written as an FTW directory in bfloat16 with
the tokenizer and ``train_log.json`` (losses, baselines, routing, timing, machine).

  python -m ftjax.tiny.train --out=/tmp/tiny                    # the shipped default model
  python -m ftjax.tiny.train --out=/tmp/hybrid --arch=hybrid    # the shipped hybrid model
  python -m ftjax.tiny.train --out=/tmp/t --steps=20 --tiny     # a smoke run (seconds)

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
from ftjax.model.router import route
from ftjax.model.transformer import init_mtp_state, init_state
from ftjax.research import routing_stats
from ftjax.research.traces import Trace
from ftjax.runtime import model as model_lib
from ftjax.utils.progress import Progress

EOS = "<|endoftext|>"
# Qwen's chat tokens, in the order of Qwen's ids, as the last ids of the vocabulary (after
# the BPE tokens, as in Qwen's tokenizers). As there, the two turn markers are special
# tokens and the others added tokens that are not special, so that decoding with
# ``skip_special_tokens`` keeps the reasoning and tool-call markup; all are single ids.
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>", "<think>", "</think>")
_SPECIAL_CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                  "chat_template.jinja")
ARCHS = ("moe", "hybrid")
_MODEL_TYPES = {"moe": "qwen3_moe", "hybrid": "qwen3_5_moe"}
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}

# Switch balance-loss weight per layer (summed over layers; the loss is logged whatever its
# weight). 0.01, the first default model's, kept routing so balanced that consecutive
# held-out tokens shared only 22.5% of their 4 of 32 experts (12.5% by chance; Qwen3-30B-A3B:
# 42.7%). At a quarter of the default's scale (width 128, 4 layers, 400 steps of 8 x 128
# tokens), weights 0.01 / 1e-3 / 1e-4 / 0 gave 22.7 / 25.7 / 34.1 / 43.4% overlap, the top 4
# experts of a layer taking 22 / 31 / 42 / 52% of its routes (Qwen3's top 16 of 128: 41-66%),
# at held-out losses 5.31 / 5.31 / 5.38 / 5.37 (unigram 6.66); the hybrid model with no
# balance loss 37.6%. So neither is given one: routing then shows a real model's locality.
BALANCE_COEF = 0.0


def chat_token_ids(vocab_size: int) -> dict[str, int]:
  """Token -> id of ``CHAT_TOKENS`` in a tokenizer of ``vocab_size`` trained here."""
  first = vocab_size - len(CHAT_TOKENS)
  return {token: first + i for i, token in enumerate(CHAT_TOKENS)}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything that determines the trained weights (with the corpus and the seed).

  The defaults are the ``moe`` default model; ``HYBRID`` is the hybrid one. ``arch`` names
  the family (``qwen3_moe`` or ``qwen3_5_moe``); the options after
  ``moe_intermediate_size`` are those of the hybrid family, off by default."""
  arch: str = "moe"  # one of ARCHS
  vocab_size: int = 4096
  hidden_size: int = 256
  num_layers: int = 6
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  num_experts: int = 32
  top_k: int = 4
  moe_intermediate_size: int = 64
  shared_expert_size: int = 0  # width of a sigmoid-gated shared expert; 0 for none
  full_attention_interval: int = 1  # every n-th layer full attention, the others linear
  partial_rotary_factor: float = 1.0  # RoPE on this share of each head's dims
  attn_output_gate: bool = False  # a per-head sigmoid gate on the attention output
  norm_zero_centred: bool = False  # RMSNorm scales by 1 + w
  linear_num_key_heads: int = 0  # Gated DeltaNet shapes (linear-attention layers)
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel: int = 0
  seq_len: int = 256
  batch_size: int = 16
  steps: int = 800
  learning_rate: float = 3e-3
  warmup_steps: int = 80
  weight_decay: float = 0.1
  balance_coef: float = BALANCE_COEF  # Switch load-balancing loss weight, per layer
  heldout_every: int = 100  # steps between held-out evaluations
  heldout_batches: int = 8
  heldout_mod: int = 20  # a file is held out when crc32(relative path) % heldout_mod == 0
  routing_sequences: int = 8  # held-out files whose routing each evaluation measures
  routing_tokens: int = 512  # the first tokens of each (as benchmarks/default_model.py)
  # The multi-token-prediction head (hybrid only; ``train_mtp``): its layers, and the steps of
  # the second stage that trains it on the finished, frozen model. 0: none.
  mtp_layers: int = 0
  mtp_steps: int = 0
  mtp_learning_rate: float = 3e-3
  mtp_warmup_steps: int = 30  # at most half of mtp_steps

  def __post_init__(self):
    if self.arch not in ARCHS:
      raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
    hybrid = self.full_attention_interval > 1
    if hybrid != (self.arch == "hybrid"):
      raise ValueError(f"arch={self.arch!r} but full_attention_interval="
                       f"{self.full_attention_interval}: the hybrid architecture has linear "
                       "attention layers (an interval above 1), the moe one none (1)")
    if self.mtp_layers and self.arch != "hybrid":
      raise ValueError("an MTP head is trained for the hybrid architecture (Qwen3-Next and "
                       f"Qwen3.5-MoE have one), not for arch={self.arch!r}")
    if bool(self.mtp_layers) != bool(self.mtp_steps):
      raise ValueError(f"mtp_layers={self.mtp_layers}, mtp_steps={self.mtp_steps}: an MTP head "
                       "needs training steps and steps need a head (set both or neither)")
    if self.vocab_size <= 256 + 1 + len(CHAT_TOKENS):
      raise ValueError(f"vocab_size={self.vocab_size} leaves no room for BPE merges beside the "
                       f"256 bytes and {1 + len(CHAT_TOKENS)} special tokens")

  def trunk_config(self) -> ModelConfig:
    """The model the first stage trains: ``model_config`` without the MTP head."""
    return dataclasses.replace(self.model_config(), mtp_layers=0)

  def model_config(self) -> ModelConfig:
    """The config of the model written (with the MTP head, where there is one)."""
    interval = self.full_attention_interval
    layer_types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(self.num_layers))
    return ModelConfig(
        model_type=_MODEL_TYPES[self.arch], vocab_size=self.vocab_size,
        hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, num_experts=self.num_experts,
        top_k=self.top_k, moe_intermediate_size=self.moe_intermediate_size, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=65536, layer_types=layer_types,
        qk_norm="per_head", norm_topk_prob=True,
        shared_expert_intermediate_size=self.shared_expert_size,
        shared_expert_gate=self.shared_expert_size > 0,
        partial_rotary_factor=self.partial_rotary_factor,
        attn_output_gate=self.attn_output_gate, norm_zero_centred=self.norm_zero_centred,
        linear_num_key_heads=self.linear_num_key_heads,
        linear_num_value_heads=self.linear_num_value_heads,
        linear_key_head_dim=self.linear_key_head_dim,
        linear_value_head_dim=self.linear_value_head_dim,
        linear_conv_kernel=self.linear_conv_kernel, mtp_layers=self.mtp_layers,
        tie_word_embeddings=True,
        source_dtype="bfloat16",
        eos_token_ids=(0, chat_token_ids(self.vocab_size)["<|im_end|>"]))


# The hybrid default model: 8 layers (Gated DeltaNet x3, gated full attention, twice) of the
# default's width, attention heads and 32 experts top-4. Gated DeltaNet costs more per token
# than attention in training, so its heads are few (1 key head, 2 value heads of 64) and the
# experts narrower (32, plus a shared expert of 64): a step then takes about as long as the
# default's, and the bfloat16 weights are 18 MB. 500 steps (2.05 M tokens, 0.6 epoch): about
# 35 minutes on the 2-core machines.
HYBRID = TrainConfig(
    arch="hybrid", num_layers=8, moe_intermediate_size=32, shared_expert_size=64, steps=500,
    warmup_steps=50,
    full_attention_interval=4, partial_rotary_factor=0.25, attn_output_gate=True,
    norm_zero_centred=True, linear_num_key_heads=1, linear_num_value_heads=2,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel=4,
    mtp_layers=1, mtp_steps=1000)

# Configurations small enough for the CI smoke test (seconds on 2 cores).
SMOKE = TrainConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=16, seq_len=32,
                    batch_size=4, steps=30, learning_rate=1e-2, warmup_steps=5,
                    heldout_every=10, heldout_batches=2, routing_sequences=2,
                    routing_tokens=64)
SMOKE_HYBRID = dataclasses.replace(
    SMOKE, arch="hybrid", num_layers=4, shared_expert_size=16, full_attention_interval=4,
    partial_rotary_factor=0.25, attn_output_gate=True, norm_zero_centred=True,
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel=4, mtp_layers=1, mtp_steps=20,
    mtp_learning_rate=1e-2, mtp_warmup_steps=2)

CONFIGS = {"moe": TrainConfig(), "hybrid": HYBRID}
SMOKE_CONFIGS = {"moe": SMOKE, "hybrid": SMOKE_HYBRID}


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
  """A byte-level BPE (``tokenizers``) of ``vocab_size`` tokens: ``<|endoftext|>`` is id 0,
  ``CHAT_TOKENS`` the last ids (``chat_token_ids``), the BPE tokens those between."""
  from tokenizers import (AddedToken, Tokenizer, decoders, models,  # noqa: PLC0415
                          pre_tokenizers, trainers)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  bpe_size = vocab_size - len(CHAT_TOKENS)
  trainer = trainers.BpeTrainer(vocab_size=bpe_size, special_tokens=[EOS],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
  if tok.get_vocab_size() != bpe_size:
    raise ValueError(f"the corpus only supports a vocabulary of {tok.get_vocab_size()} tokens, "
                     f"fewer than the {bpe_size} asked for (besides {len(CHAT_TOKENS)} chat "
                     "tokens): use a larger corpus or a smaller vocabulary")
  for token in CHAT_TOKENS:  # one at a time: each gets the next id
    added = AddedToken(token, special=token in _SPECIAL_CHAT_TOKENS, normalized=False)
    if token in _SPECIAL_CHAT_TOKENS:
      tok.add_special_tokens([added])
    else:
      tok.add_tokens([added])
  ids = {token: tok.token_to_id(token) for token in CHAT_TOKENS}
  assert ids == chat_token_ids(vocab_size), ids
  return tok


def tokenizer_config(max_length: int) -> dict:
  """``tokenizer_config.json`` for transformers: a fast tokenizer with Qwen's chat template
  (``chat_template.jinja``); ``<|endoftext|>`` ends a text and pads."""
  with open(CHAT_TEMPLATE_PATH) as f:
    template = f.read()
  return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS,
          "pad_token": EOS, "unk_token": None, "model_max_length": max_length,
          "clean_up_tokenization_spaces": False, "chat_template": template}


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


def _forward(params, bank, graphdef, config: ModelConfig, inputs):
  """Teacher-forced forward of inputs [B, T]: (logits [B, T, V], router logits per layer,
  each [B·T, E])."""
  model = nnx.merge(graphdef, params)
  b, t = inputs.shape
  state = init_state(config, b, t)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  experts = BankExperts(bank=bank, ffn_dim=config.moe_intermediate_size, kernels="xla")
  (_, _, logits), intermediates = nnx.capture(model, nnx.Intermediate)(
      state, inputs, positions, experts, kernels="xla", fresh=True, sow_router_logits=True)
  router_logits_per_layer = jax.tree.leaves(intermediates)
  assert len(router_logits_per_layer) == config.num_layers, len(router_logits_per_layer)
  return logits, router_logits_per_layer


def loss_fn(params, bank, graphdef, config: ModelConfig, tokens, balance_coef: float):
  """Mean next-token cross-entropy (nats) + balance_coef · Σ_layers Switch balance loss.

  tokens [B, T+1]. Returns (total, (cross-entropy, balance))."""
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  logits, router_logits_per_layer = _forward(params, bank, graphdef, config, inputs)
  logp = jax.nn.log_softmax(logits, axis=-1)
  ce = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
  balance = jnp.zeros((), jnp.float32)
  for router_logits in router_logits_per_layer:
    probs = jax.nn.softmax(router_logits, axis=-1)  # [B·T, E]
    _, ids = jax.lax.top_k(router_logits, config.top_k)
    chosen = jnp.sum(jax.nn.one_hot(ids, config.num_experts), axis=1)  # [B·T, E]
    frac = jnp.mean(chosen, axis=0) / config.top_k  # share of routes per expert
    balance += config.num_experts * jnp.sum(frac * jnp.mean(probs, axis=0))
  return ce + balance_coef * balance, (ce, balance)


def make_step(graphdef, config: ModelConfig, opt, balance_coef: float):
  """Jitted ``step`` (one AdamW update), ``evaluate`` (cross-entropy of a batch) and
  ``routes`` (each token's experts and weights, as the engine's router chooses them)."""

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

  @jax.jit
  def routes(params, bank, tokens):
    """tokens [B, T] -> (ids, weights), each [B·T, L, K] (token-major, as a trace)."""
    _, router_logits_per_layer = _forward(params, bank, graphdef, config, tokens)
    weights, ids = zip(*(route(logits, kind=config.router, top_k=config.top_k,
                               norm_topk_prob=config.norm_topk_prob)
                         for logits in router_logits_per_layer))
    return jnp.stack(ids, axis=1), jnp.stack(weights, axis=1)

  return step, evaluate, routes


def routing_sequences(tok, texts: list[str], n: int, length: int) -> np.ndarray:
  """The first ``length`` tokens of each of the first ``n`` texts that have as many:
  [S, length] int32 (natural code from the start of a file)."""
  seqs = []
  for text in texts:
    ids = tok.encode(text).ids
    if len(ids) >= length:
      seqs.append(ids[:length])
      if len(seqs) == n:
        break
  if not seqs:
    raise ValueError(f"no held-out file has {length} tokens to measure routing on")
  return np.asarray(seqs, np.int32)


def heldout_routing(routes, params, bank, sequences: np.ndarray, num_experts: int) -> dict:
  """``routing_stats.summary`` of the routing of ``sequences`` [S, T] by the weights as
  written (rounded to bfloat16), the sequences concatenated, one step per token (as
  ``benchmarks/default_model.py`` measures the model card's routing)."""
  stored = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (params, bank))
  ids, weights = routes(*stored, jnp.asarray(sequences))
  trace = Trace.from_arrays(np.asarray(ids), np.asarray(weights), num_experts)
  stats = routing_stats.summary(trace, phase=None)
  stats["sequences"], stats["tokens"] = int(sequences.shape[0]), int(sequences.shape[1])
  return stats


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


# ----------------------------------------------------------------------------- the MTP head


def _trunk_forward(params, bank, graphdef, config: ModelConfig, inputs):
  """inputs [B, T] -> (hidden [B, T, D] after the final norm, log-probabilities [B, T, V]) of
  the finished model (no gradient is taken through it)."""
  model = nnx.merge(graphdef, params)
  b, t = inputs.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  experts = BankExperts(bank=bank, ffn_dim=config.moe_intermediate_size, kernels="xla")
  _, _, hidden, logits, _ = model.hidden_and_logits(init_state(config, b, t), inputs, positions,
                                                    experts, kernels="xla", fresh=True)
  return hidden, jax.nn.log_softmax(logits, axis=-1)


def mtp_loss(head, head_bank, rest, trunk_bank, graphdef, config: ModelConfig, inputs, hidden,
             trunk_logp):
  """The head's self-distillation loss on a batch, with its agreement and corpus loss.

  At each position p < T - 1 the head reads the model's hidden state h_p and the next input
  token x_{p+1} (``Transformer.mtp_step`` at depth 0) and predicts the token after, x_{p+2}.
  Its target is the model's own distribution there, ``trunk_logp[:, p + 1]`` (cross-entropy
  against it: the KL divergence up to the model's entropy), because a draft is accepted when it
  is the token the model would emit, not the token the corpus has. Returns (loss, (agreement:
  the share of positions whose top token is the model's, cross-entropy against the corpus's
  x_{p+2}))."""
  model = nnx.merge(graphdef, head, rest)
  b, t = inputs.shape
  positions = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
  bank = jnp.concatenate([trunk_bank, head_bank])
  experts = BankExperts(bank=bank, ffn_dim=config.moe_intermediate_size, kernels="xla")
  _, _, _, logits = model.mtp_step(init_mtp_state(config, b, t - 1), jnp.zeros((), jnp.int32),
                                   hidden[:, :-1], inputs[:, 1:], positions, experts,
                                   kernels="xla", fresh=True)
  logp = jax.nn.log_softmax(logits, axis=-1)  # [B, T - 1, V]: the token at p + 2
  target = trunk_logp[:, 1:]
  loss = -jnp.mean(jnp.sum(jnp.exp(target) * logp, axis=-1))
  agreement = jnp.mean(jnp.argmax(logp, -1) == jnp.argmax(target, -1))
  corpus = -jnp.mean(jnp.take_along_axis(logp[:, :-1], inputs[:, 2:, None], axis=-1))
  return loss, (agreement, corpus)


def train_mtp(trunk: model_lib.Model, stream: np.ndarray, held_stream: np.ndarray,
              cfg: TrainConfig, *, seed: int = 0, log=sys.stderr, progress: bool = True
              ) -> tuple[model_lib.Model, dict]:
  """Trains a multi-token-prediction head (``cfg.mtp_layers``, ``cfg.mtp_steps``) on the
  finished model ``trunk``, whose weights stay as they are: the head is initialised by
  ``model_lib.with_mtp_head`` and trained alone (its fc, norms, attention, shared expert and its
  own routed experts, the bank's layers after the model's), with AdamW on ``mtp_loss`` over the
  same random windows. The embedding and lm_head it reads are the model's and stay frozen.
  The model's weights are read as written (bfloat16, so the head learns the model that ships);
  the head is trained in float32. Returns (the model with the head, the log)."""
  written = dataclasses.replace(trunk, params=jax.tree.map(
      lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), trunk.params),
      bank=jnp.asarray(trunk.bank).astype(jnp.bfloat16).astype(jnp.float32))
  model = model_lib.with_mtp_head(written, cfg.mtp_layers, seed=seed)
  config, n = model.config, trunk.config.num_moe_layers
  trunk_bank, head_bank = model.bank[:n], model.bank[n:]
  graphdef, head, rest = nnx.split(nnx.merge(model.graphdef, model.params),
                                   nnx.PathContains("mtp"), ...)
  warmup = min(cfg.mtp_warmup_steps, cfg.mtp_steps // 2)  # --mtp_steps may be short
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.mtp_learning_rate, warmup,
                                                cfg.mtp_steps, cfg.mtp_learning_rate * 0.05)
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
  opt_state = opt.init((head, head_bank))

  # The model's weights go in as arguments, not closed over (they would become constants).
  @jax.jit
  def forward_jit(params, bank, tokens):
    inputs = tokens[:, :-1]
    return (inputs,) + _trunk_forward(params, bank, model.graphdef, config, inputs)

  def forward(tokens):  # the model's part of a batch: (inputs, hidden, log-probabilities)
    return forward_jit(model.params, model.bank, tokens)

  @jax.jit
  def step(head, head_bank, opt_state, rest, trunk_bank, inputs, hidden, trunk_logp):
    grad_fn = jax.value_and_grad(mtp_loss, argnums=(0, 1), has_aux=True)
    (loss, aux), grads = grad_fn(head, head_bank, rest, trunk_bank, graphdef, config, inputs,
                                 hidden, trunk_logp)
    updates, opt_state = opt.update(grads, opt_state, (head, head_bank))
    head, head_bank = optax.apply_updates((head, head_bank), updates)
    return head, head_bank, opt_state, loss, aux

  @jax.jit
  def evaluate(head, head_bank, rest, trunk_bank, inputs, hidden, trunk_logp):
    return mtp_loss(head, head_bank, rest, trunk_bank, graphdef, config, inputs, hidden,
                    trunk_logp)

  held = heldout_windows(held_stream, cfg.heldout_batches * cfg.batch_size, cfg.seq_len)
  held = [forward(jnp.asarray(np.stack(held[i:i + cfg.batch_size])))
          for i in range(0, len(held), cfg.batch_size)]

  def heldout():
    rows = [evaluate(head, head_bank, rest, trunk_bank, *h) for h in held]
    return tuple(float(np.mean([float(x) for x in col]))
                 for col in zip(*((loss,) + aux for loss, aux in rows)))

  rng = np.random.default_rng(seed + 1)
  h_loss, agreement, corpus = heldout()  # the random head, for comparison
  history, window = [{"step": 0, "train_loss": None, "heldout_loss": h_loss,
                      "heldout_agreement": agreement, "heldout_corpus_loss": corpus,
                      "elapsed_s": 0.0}], []
  bar = Progress(cfg.mtp_steps, desc="training the MTP head", enabled=progress)
  start = time.perf_counter()
  for i in range(1, cfg.mtp_steps + 1):
    batch = forward(jnp.asarray(batches(stream, cfg.batch_size, cfg.seq_len, rng)))
    head, head_bank, opt_state, loss, _ = step(head, head_bank, opt_state, rest, trunk_bank,
                                               *batch)
    window.append(loss)
    bar.update()
    if i % cfg.heldout_every == 0 or i == cfg.mtp_steps:
      train_loss = float(np.mean([float(x) for x in window]))
      window = []
      h_loss, agreement, corpus = heldout()
      if not math.isfinite(h_loss):
        raise FloatingPointError(f"the MTP head's held-out loss became {h_loss} at step {i}")
      history.append({"step": i, "train_loss": train_loss, "heldout_loss": h_loss,
                      "heldout_agreement": agreement, "heldout_corpus_loss": corpus,
                      "elapsed_s": time.perf_counter() - start})
      log.write(f"\nMTP step {i}: distillation loss train {train_loss:.3f}, held-out "
                f"{h_loss:.3f}; the head's top token is the model's at {100 * agreement:.1f}% "
                f"of held-out positions; corpus loss of the token after next {corpus:.3f}\n")
  bar.close()
  params = nnx.split(nnx.merge(graphdef, head, rest))[1]
  trained = dataclasses.replace(model, params=params,
                                bank=jnp.concatenate([trunk_bank, head_bank]))
  last = history[-1]
  return trained, {"layers": cfg.mtp_layers, "steps": cfg.mtp_steps,
                   "heldout_loss": last["heldout_loss"],
                   "heldout_agreement": last["heldout_agreement"],
                   "heldout_corpus_loss": last["heldout_corpus_loss"],
                   "train_seconds": time.perf_counter() - start, "history": history}


def train(out_dir: str, cfg: TrainConfig = TrainConfig(), *, seed: int = 0,
          corpus: str | None = None, corpus_bytes: int | None = None, log=sys.stderr,
          progress: bool = True) -> dict:
  """Trains and writes the model to ``out_dir`` (FTW bf16 + tokenizer.json +
  tokenizer_config.json + train_log.json). Returns the training log, with the held-out
  routing statistics. ``corpus_bytes`` caps the text read (smoke tests)."""
  t0 = time.perf_counter()
  root, train_texts, held_texts = read_corpus(corpus, cfg, corpus_bytes, log)
  tok = train_tokenizer(train_texts, cfg.vocab_size)
  train_stream, held_stream = encode(tok, train_texts), encode(tok, held_texts)
  train_bytes = sum(len(t.encode()) for t in train_texts) + len(train_texts)
  held_bytes = sum(len(t.encode()) for t in held_texts) + len(held_texts)
  unigram = unigram_loss(train_stream, held_stream, cfg.vocab_size)
  log.write(f"tokenizer: BPE {cfg.vocab_size}; train {len(train_stream)} tokens, held-out "
            f"{len(held_stream)} tokens ({held_bytes / len(held_stream):.2f} bytes/token); "
            f"unigram held-out loss {unigram:.3f} nats/token\n")

  config = cfg.trunk_config()
  model = model_lib.random_model(config, seed=seed, dtype="float32")
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                                cfg.steps, cfg.learning_rate * 0.05)
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
  params, bank = model.params, model.bank
  opt_state = opt.init((params, bank))
  step, evaluate, routes = make_step(model.graphdef, config, opt, cfg.balance_coef)
  held = [jnp.asarray(w[None]) for w in heldout_windows(held_stream, cfg.heldout_batches *
                                                          cfg.batch_size, cfg.seq_len)]
  held = [jnp.concatenate(held[i:i + cfg.batch_size]) for i in range(0, len(held),
                                                                      cfg.batch_size)]

  routed = routing_sequences(tok, held_texts, cfg.routing_sequences, cfg.routing_tokens)

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
      routing = heldout_routing(routes, params, bank, routed, cfg.num_experts)
      overlap = routing["consecutive_overlap"]["mean"]
      history.append({"step": i, "train_loss": train_ce, "heldout_loss": h,
                      "balance": float(bal), "expert_overlap": overlap,
                      "elapsed_s": time.perf_counter() - train_start})
      log.write(f"\nstep {i}: train {train_ce:.3f}, held-out {h:.3f} nats/token "
                f"(unigram {unigram:.3f}), balance {float(bal) / cfg.num_layers:.3f}, "
                f"held-out expert overlap {100 * overlap:.1f}%\n")
  bar.close()
  train_s = time.perf_counter() - train_start
  final = history[-1]["heldout_loss"]
  log.write(f"held-out routing ({routing['sequences']} files x {routing['tokens']} tokens): "
            f"consecutive-token expert overlap {100 * overlap:.1f}% (by chance "
            f"{100 * cfg.top_k / cfg.num_experts:.1f}%), per layer "
            + " / ".join(f"{100 * x:.0f}" for x in routing["consecutive_overlap"]["per_layer"])
            + "\n")
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
      "heldout_expert_overlap": overlap, "heldout_routing": routing,
      "heldout_bits_per_byte": final / math.log(2) * len(held_stream) / held_bytes,
      "unigram_bits_per_byte": unigram / math.log(2) * len(held_stream) / held_bytes,
      "train_seconds": train_s, "total_seconds": time.perf_counter() - t0, "history": history,
  }
  trained = dataclasses.replace(model, params=params, bank=bank)
  source = {"kind": "trained", "trained": True, "seed": seed, "generator": "ftjax.tiny.train",
            "arch": cfg.arch,
            "corpus": "Python standard library sources (PSF licence)",
            "python": platform.python_version(), "heldout_loss": final,
            "heldout_expert_overlap": overlap, "steps": cfg.steps}
  if cfg.mtp_layers:
    trained, result["mtp"] = train_mtp(trained, train_stream, held_stream, cfg, seed=seed,
                                       log=log, progress=progress)
    source["mtp"] = _mtp_source(result["mtp"])
    result["total_seconds"] = time.perf_counter() - t0
  write_model(trained, tok, result, out_dir, source)
  return result


def _mtp_source(mtp: dict) -> dict:
  return {k: mtp[k] for k in ("layers", "steps", "heldout_loss", "heldout_agreement")}


def read_corpus(corpus: str | None, cfg: TrainConfig, corpus_bytes: int | None = None,
                log=sys.stderr) -> tuple[str, list[str], list[str]]:
  """(root, train texts, held-out texts) of the corpus (default: the standard library)."""
  root = corpus or stdlib_root()
  train_files, held_files = corpus_files(root, cfg.heldout_mod)
  train_texts = read_texts(root, train_files, corpus_bytes)
  held_texts = read_texts(root, held_files, None if corpus_bytes is None else corpus_bytes // 4)
  log.write(f"corpus: {root}: {len(train_texts)} train files "
            f"({sum(map(len, train_texts)) / 1e6:.1f} MB), {len(held_texts)} held-out files\n")
  return root, train_texts, held_texts


def train_head(trunk_dir: str, out_dir: str, cfg: TrainConfig = HYBRID, *, seed: int = 0,
               corpus: str | None = None, corpus_bytes: int | None = None, log=sys.stderr,
               progress: bool = True) -> dict:
  """The MTP stage alone (``train_mtp``): adds a head trained on the model in ``trunk_dir`` (an
  FTW directory written by ``train``, with its tokenizer), whose weights are copied unchanged,
  and writes the result to ``out_dir``. Equal to ``train`` with the same configuration and
  seed when ``trunk_dir`` is what ``train``'s first stage wrote (it is deterministic).
  Returns the log: the trunk's ``train_log.json`` with ``"mtp"`` added."""
  from tokenizers import Tokenizer  # noqa: PLC0415
  if not cfg.mtp_layers:
    raise ValueError(f"the {cfg.arch} configuration trains no MTP head (mtp_layers=0)")
  trunk = model_lib.load(trunk_dir)
  if trunk.config.mtp_layers:
    raise ValueError(f"{trunk_dir} has an MTP head already: pass the model without one")
  if trunk.config != cfg.trunk_config():
    raise ValueError(f"{trunk_dir} is not the model this configuration trains (its model "
                     f"config differs from the {cfg.arch} configuration's): pass --arch and "
                     "--tiny as it was trained")
  tok = Tokenizer.from_file(os.path.join(trunk_dir, "tokenizer.json"))
  _, train_texts, held_texts = read_corpus(corpus, cfg, corpus_bytes, log)
  train_stream, held_stream = encode(tok, train_texts), encode(tok, held_texts)
  model, mtp = train_mtp(trunk, train_stream, held_stream, cfg, seed=seed, log=log,
                         progress=progress)
  with open(os.path.join(trunk_dir, "train_log.json")) as f:
    result = json.load(f)
  result["config"] = dataclasses.asdict(cfg)  # the trunk's fields are equal (checked above)
  result["mtp"] = mtp
  source = dict(trunk.source or {}, mtp=_mtp_source(mtp))
  write_model(model, tok, result, out_dir, source)
  return result


def write_model(model, tok, result: dict, out_dir: str, source: dict) -> str:
  """Writes FTW (bf16) + tokenizer.json + tokenizer_config.json (the chat template) +
  train_log.json into a temp dir, then renames."""
  parent = os.path.dirname(os.path.abspath(out_dir)) or "."
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".ftjax-train-", dir=parent)
  os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is a normal directory
  try:
    model_lib.save(model, tmp, dtype="bfloat16", source=source)
    tok.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
      json.dump(tokenizer_config(model.config.max_position_embeddings), f, indent=1)
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
  cfg = (SMOKE_CONFIGS if _TINY.value else CONFIGS)[_ARCH.value]
  overrides = {k: v for k, v in (("steps", _STEPS.value), ("balance_coef", _BALANCE_COEF.value),
                                 ("mtp_steps", _MTP_STEPS.value)) if v is not None}
  cfg = dataclasses.replace(cfg, **overrides)
  try:
    if _TRUNK_FROM.value:
      result = train_head(_TRUNK_FROM.value, _OUT.value, cfg, seed=_SEED.value,
                          corpus=_CORPUS.value)
    else:
      result = train(_OUT.value, cfg, seed=_SEED.value, corpus=_CORPUS.value)
  except (ValueError, FileNotFoundError, FileExistsError) as e:
    raise SystemExit(f"ftjax.tiny.train: error: {e}") from None
  if "mtp" in result:
    mtp = result["mtp"]
    print(f"MTP head: the model's next-next token at {100 * mtp['heldout_agreement']:.1f}% of "
          f"held-out positions (distillation loss {mtp['heldout_loss']:.3f}), after "
          f"{mtp['train_seconds'] / 60:.1f} min")
  print(f"{cfg.arch}: held-out loss {result['heldout_loss']:.3f} nats/token "
        f"({result['heldout_bits_per_byte']:.3f} bits/byte; unigram "
        f"{result['unigram_heldout_loss']:.3f}), consecutive-token expert overlap "
        f"{100 * result['heldout_expert_overlap']:.1f}%, after "
        f"{result['train_seconds'] / 60:.1f} min; wrote {_OUT.value}")


if __name__ == "__main__":
  from absl import app, flags
  _OUT = flags.DEFINE_string("out", None, "output directory (FTW)", required=True)
  _ARCH = flags.DEFINE_enum("arch", "moe", ARCHS, "moe: the qwen3_moe default model; hybrid: "
                            "the qwen3_5_moe-style one (Gated DeltaNet and full attention)")
  _STEPS = flags.DEFINE_integer("steps", None, "training steps (default: the config's)",
                                lower_bound=1)
  _MTP_STEPS = flags.DEFINE_integer("mtp_steps", None, "training steps of the MTP head "
                                    "(hybrid; default: the config's)", lower_bound=1)
  _BALANCE_COEF = flags.DEFINE_float("balance_coef", None, "Switch balance-loss weight per "
                                     "layer (default: the config's)", lower_bound=0.0)
  _SEED = flags.DEFINE_integer("seed", 0, "seed for init and batch order")
  _CORPUS = flags.DEFINE_string("corpus", None, "directory of .py files (default: the stdlib)")
  _TINY = flags.DEFINE_bool("tiny", False, "the smoke-test configuration (seconds)")
  _TRUNK_FROM = flags.DEFINE_string(
      "trunk_from", None, "skip the first stage: train only the MTP head (hybrid) on the model "
      "in this FTW directory, which --out gets unchanged, with the head")
  app.run(main)
