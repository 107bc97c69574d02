"""How well a layer's experts can be known before the layer runs (issue 52, item 2):
per-layer recall of the true top-k for each predictor, on the embedded trained models.

For held-out text (windows of standard-library source the embedded models never trained
on: ``ftjax.tiny.train.corpus_files`` holds out every ``heldout_mod``-th file), a teacher-forced
forward in float32 records, at each layer l, the residual entering it (x_l) and the experts
its router chose. The experts of layer l + 1 are then predicted by:

  ahead_1     layer l + 1's norm and router applied to x_l: known when layer l starts, a
              whole layer before they are needed (what a prefetch overlapping layer l uses;
              the moe-stream / Pre-gated MoE predictor);
  ahead_0     the same applied to x_{l+1}, the residual before layer l + 1's attention: known
              only one sublayer before (the variant with the least lead time);
  last_token  the experts layer l + 1 chose for the previous token (temporal reuse).

recall@k = |predicted top-k ∩ true top-k| / k, averaged over the tokens of each layer; with
exactly k predicted per layer it is also the share of a prefetch of those k that is used.
Layer 0 has no earlier layer (ahead_1 / ahead_0 start at layer 1).

  /work/venv/bin/python benchmarks/router_ahead.py [--tokens 2048]

Writes ``results/router_ahead.json`` and ``results/router_ahead.png`` (recall per layer).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, pyplot, write_results  # noqa: E402

import ftjax  # noqa: E402
from ftjax.experts.routed import BankExperts  # noqa: E402
from ftjax.model import init_state  # noqa: E402
from ftjax.model.layers import embed_rows  # noqa: E402
from ftjax.model.router import route  # noqa: E402
from ftjax.runtime.tokenizer import load_tokenizer  # noqa: E402
from ftjax.tiny import train  # noqa: E402

PREDICTORS = ("ahead_1", "ahead_0", "last_token")


def heldout_tokens(model, n: int) -> np.ndarray:
  """``n`` tokens of held-out standard-library source."""
  tok = load_tokenizer(model.path, model.config.vocab_size)
  root = train.stdlib_root()
  _, held = train.corpus_files(root)
  ids: list[int] = []
  for text in train.read_texts(root, held, limit_bytes=16 * n):
    ids += tok.encode(text)
    if len(ids) >= n:
      break
  if len(ids) < n:
    raise RuntimeError(f"only {len(ids)} held-out tokens found, {n} asked")
  return np.asarray(ids[:n], np.int32)


def _top_ids(moe, logits: jax.Array) -> jax.Array:
  """The top-k expert ids [T, K] layer ``moe``'s routing picks from its router logits."""
  bias = moe.b_router_e[...].astype(jnp.float32) if moe.router == "sigmoid_group" else None
  return route(logits, kind=moe.router, top_k=moe.top_k, norm_topk_prob=moe.norm_topk_prob,
               bias=bias, n_group=moe.router_groups, topk_group=moe.router_topk_groups,
               scaling=moe.scaling)[1]


def _router_ids(moe, x2: jax.Array) -> jax.Array:
  """The top-k expert ids [T, K] layer ``moe``'s router chooses for normed inputs [T, D]."""
  logits = x2 @ moe.w_router_ed[...].T.astype(jnp.float32)
  if moe.router_bias:
    logits = logits + moe.b_logits_e[...].astype(jnp.float32)
  return _top_ids(moe, logits)


def record(model, tokens: np.ndarray):
  """(x_l per layer [L + 1, T, D], true ids per layer [L, T, K]) of one teacher-forced pass."""
  net = nnx.merge(model.graphdef, model.params)
  config = model.config
  t = len(tokens)
  ids = jnp.asarray(tokens)[None]
  state = init_state(config, 1, t)
  positions = jnp.arange(t, dtype=jnp.int32)[None]
  experts = BankExperts(bank=model.bank, ffn_dim=config.moe_intermediate_size, kernels="xla")
  x = embed_rows(net.embed_vd, ids)
  inputs, chosen = [], []
  for i, layer in enumerate(net.layers):
    inputs.append(x[0])
    (_, experts, x), captured = nnx.capture(layer, nnx.Intermediate)(
        x, state.layers[i], state.length, positions, i, experts, kernels="xla", fresh=True,
        valid=None, sow_router_logits=True)
    chosen.append(_top_ids(layer.moe, jax.tree.leaves(captured)[0]))
  inputs.append(x[0])
  return net, jnp.stack(inputs), jnp.stack(chosen)


def recall(predicted: np.ndarray, true: np.ndarray) -> float:
  """Mean over tokens of |predicted ∩ true| / k; both [T, K]."""
  hits = (predicted[:, :, None] == true[:, None, :]).any(-1).sum(-1)
  return float(hits.mean() / true.shape[1])


def measure(name: str, tokens: int) -> dict:
  model = ftjax.load(name)
  seq = heldout_tokens(model, tokens)
  net, inputs, chosen = record(model, seq)
  chosen = np.asarray(chosen)
  layers = model.config.num_layers
  out = {p: [None] * layers for p in PREDICTORS}
  for nxt in range(1, layers):
    target = net.layers[nxt]
    true = chosen[nxt]
    for p, x in (("ahead_1", inputs[nxt - 1]), ("ahead_0", inputs[nxt])):
      out[p][nxt] = recall(np.asarray(_router_ids(target.moe, target.mlp_norm(x))), true)
  for layer in range(layers):
    out["last_token"][layer] = recall(chosen[layer][:-1], chosen[layer][1:])
  summary = {p: float(np.mean([v for v in out[p] if v is not None])) for p in PREDICTORS}
  return {"model": name, "model_type": model.config.model_type, "layers": layers,
          "experts": model.config.num_experts, "top_k": model.config.top_k,
          "tokens": int(len(seq)), "per_layer": out, "mean": summary}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default="default,default-hybrid")
  p.add_argument("--tokens", type=int, default=2048, help="held-out tokens per model")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  runs = [measure(m, args.tokens) for m in args.models.split(",")]
  for r in runs:
    print(f"{r['model']} ({r['model_type']}, {r['layers']} layers, top-{r['top_k']} of "
          f"{r['experts']}, {r['tokens']} held-out tokens): " + ", ".join(
              f"{k} recall {v:.3f}" for k, v in r["mean"].items()))
  results = {"benchmark": "router_ahead", "command": " ".join(sys.argv),
             "machine": machine_info(), "runs": runs}
  path = write_results("router_ahead", results, args.out)
  plt = pyplot()
  if plt is not None:
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6), squeeze=False)
    for ax, r in zip(axes[0], runs):
      for pred in PREDICTORS:
        ys = r["per_layer"][pred]
        xs = [i for i, v in enumerate(ys) if v is not None]
        ax.plot(xs, [ys[i] for i in xs], marker="o", label=pred)
      ax.set_title(f"{r['model']}: top-{r['top_k']} of {r['experts']}")
      ax.set_xlabel("layer predicted")
      ax.set_ylabel("recall@k")
      ax.set_ylim(0, 1)
      ax.grid(alpha=0.3)
      ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=120)
  print(f"results: {path}")


if __name__ == "__main__":
  main()
