"""The float64 numpy reference of the MoE, for every test (STYLE.md section 8).

Straight from the definitions, in loops, with no shortcut shared with the code under test:

* ``route``: router logits -> (weights, ids) for each router kind of ``ftjax.model.router``;
* ``routed_experts``: the weighted sum of the routed SwiGLU experts of one bank layer, one
  expert at a time (all of its routes at once);
* ``moe_layer``: both, for one MoE layer without a shared expert;
* ``attention``: grouped-query attention of T queries against a KV cache, one query at a time.

The bank is ``[L, E, P]``: block ``bank[l, e]`` holds ``gate [F, D]`` at element 0, ``up
[F, D]`` at ``F·D`` and ``down [D, F]`` at ``2·F·D``; with biases (gpt-oss) the gate bias
``[F]``, up bias ``[F]`` and down bias ``[D]`` follow; the tail up to ``P`` is padding.
Inputs are widened to float64 exactly (bfloat16 and float32 values are float64 values), so a
reference built from the same rounded weights differs from a fast path only by the fast
path's arithmetic (``tolerances.py``).
"""

from __future__ import annotations

import numpy as np


def _align64(n: int) -> int:
  return -(-n // 64) * 64


def e2m1(code: int) -> float:
  """The value of a 4-bit E2M1 code from its bits (sign, 2 exponent bits, 1 mantissa bit; bias
  1; exponent 0 is subnormal), written from the OCP MX spec, not from a table."""
  sign = -1.0 if code & 8 else 1.0
  exponent, mantissa = (code >> 1) & 3, code & 1
  if exponent == 0:
    return sign * 0.5 * mantissa
  return sign * 2.0 ** (exponent - 1) * (1.0 + 0.5 * mantissa)


def mxfp4_matrix(codes, scales, rows: int, cols: int):
  """[rows, cols] float64 from codes (cols/2 bytes a row; input 2j in the low nibble of byte
  j, 2j + 1 in the high one) and E8M0 scales (cols/32 a row, 2^(e - 127)), element by element."""
  codes = np.asarray(codes).reshape(rows, cols // 2)
  scales = np.asarray(scales).reshape(rows, cols // 32)
  out = np.empty((rows, cols))
  for r in range(rows):
    for i in range(cols):
      byte = int(codes[r, i // 2])
      code = byte & 15 if i % 2 == 0 else byte >> 4
      out[r, i] = e2m1(code) * 2.0 ** (int(scales[r, i // 32]) - 127)
  return out


def mxfp4_parts(block, ffn_dim: int, width: int):
  """An mxfp4 block (docs/ftw.md, uint8) -> gate, up, down (float64) and the float32 biases
  gate [F], up [F], down [D] as float64. Codes of gate [F, D/2], up, down [D, F/2] from byte 0,
  scales from S = align64(3·F·D/2), biases from S + align64(3·F·D/32)."""
  raw = np.asarray(block)
  f, d = ffn_dim, width
  fd = f * d
  scales_at = _align64(3 * fd // 2)
  biases_at = scales_at + _align64(3 * fd // 32)
  weights = []
  for part, (rows, cols) in enumerate(((f, d), (f, d), (d, f))):
    codes = raw[part * fd // 2:(part + 1) * fd // 2]
    scales = raw[scales_at + part * fd // 32:scales_at + (part + 1) * fd // 32]
    weights.append(mxfp4_matrix(codes, scales, rows, cols))
  biases = raw[biases_at:biases_at + 4 * (2 * f + d)].view("<f4").astype(np.float64)
  return weights, (biases[:f], biases[f:2 * f], biases[2 * f:])


def split_block(block, ffn_dim: int, width: int):
  """One expert block [P] -> gate [F, D], up [F, D], down [D, F], float64.

  An int8 block (docs/ftw.md, expert format int8) is dequantised: its int8 weights times the
  float32 scale of their row, read from byte 3·F·D rounded up to 64 (gate [F], up [F], down
  [D]). An mxfp4 block (uint8) is dequantised by ``mxfp4_parts``, an int4 block (uint16
  words) by ``int4_parts``."""
  fd = ffn_dim * width
  if np.asarray(block).dtype == np.uint8:  # mxfp4
    return tuple(mxfp4_parts(block, ffn_dim, width)[0])
  if np.asarray(block).dtype == np.uint16:  # int4
    return int4_parts(block, ffn_dim, width)
  if np.asarray(block).dtype == np.int8:
    raw = np.asarray(block)
    start = -(-3 * fd // 64) * 64
    scales = raw[start:start + 4 * (2 * ffn_dim + width)].view("<f4").astype(np.float64)
    rows = np.concatenate([np.repeat(scales[:2 * ffn_dim], width),
                           np.repeat(scales[2 * ffn_dim:], ffn_dim)])
    block = raw[:3 * fd].astype(np.float64) * rows
  else:
    block = np.asarray(block).astype(np.float64)
  return (block[:fd].reshape(ffn_dim, width), block[fd:2 * fd].reshape(ffn_dim, width),
          block[2 * fd:3 * fd].reshape(width, ffn_dim))


def int4_parts(block, ffn_dim: int, width: int):
  """gate [F, D], up [F, D], down [D, F] (float64) of an int4 block (docs/ftw.md, written out
  here from the spec): codes from byte 0 (low nibble first), then from 3·F·D/2 rounded up to
  64 bytes each row's parameters: float32 d, dm, uint8 scales and int8 mins per 32 inputs;
  w = float32(d·s·q + dm·m)."""
  raw = np.ascontiguousarray(block).view(np.uint8).reshape(-1)
  f, d = ffn_dim, width
  at_params = -(-3 * f * d // 2 // 64) * 64
  out, code_at, param_at = [], 0, at_params
  for rows, n in ((f, d), (f, d), (d, f)):
    codes = raw[code_at:code_at + rows * n // 2].reshape(rows, n // 2)
    code_at += rows * n // 2
    g = n // 32
    params = raw[param_at:param_at + rows * (8 + 2 * g)].reshape(rows, 8 + 2 * g)
    param_at += rows * (8 + 2 * g)
    steps = params[:, :8].copy().view("<f4").astype(np.float64)
    s = np.repeat(params[:, 8:8 + g].astype(np.float64), 32, axis=1)
    m = np.repeat(params[:, 8 + g:].view(np.int8).astype(np.float64), 32, axis=1)
    q = np.empty((rows, n))
    q[:, 0::2] = codes & 15
    q[:, 1::2] = codes >> 4
    out.append((steps[:, :1] * s * q + steps[:, 1:] * m).astype(np.float32).astype(np.float64))
  return tuple(out)


def split_biases(block, ffn_dim: int, width: int):
  """The biases after down in a block with biases: gate [F], up [F], down [D], float64 (an
  mxfp4 block's float32 biases after its scales)."""
  if np.asarray(block).dtype == np.uint8:
    return mxfp4_parts(block, ffn_dim, width)[1]
  block = np.asarray(block).astype(np.float64)
  start = 3 * ffn_dim * width
  return (block[start:start + ffn_dim], block[start + ffn_dim:start + 2 * ffn_dim],
          block[start + 2 * ffn_dim:start + 2 * ffn_dim + width])


def gpt_oss_glu(gate, up, *, alpha: float, limit: float):
  """gpt-oss's clamped SwiGLU, elementwise in float64, as transformers writes it."""
  gate = np.minimum(gate, limit)
  up = np.clip(up, -limit, limit)
  return (up + 1.0) * (gate / (1.0 + np.exp(-gate * alpha)))


def routed_experts(x, ids, weights, bank, layer: int, ffn_dim: int, *,
                   activation: str = "swiglu", alpha: float = 1.702, limit: float = 7.0,
                   bias: bool = False) -> np.ndarray:
  """``y[t] = sum_k weights[t, k] · expert_{ids[t, k]}(x[t])`` over layer ``layer`` of
  ``bank``, with ``expert(x) = down · (silu(gate · x) * (up · x))``; ids -1 = no route.
  ``activation="clamped_swiglu"`` is gpt-oss's (``gpt_oss_glu``); ``bias`` adds each
  block's gate, up and down biases.

  x [T, D], ids and weights [T, K]. Returns [T, D] float64."""
  x_td = np.asarray(x, np.float64)
  ids_tk = np.asarray(ids)
  weights_tk = np.asarray(weights, np.float64)
  bank_ep = np.asarray(bank[layer])
  width = x_td.shape[1]
  y_td = np.zeros(x_td.shape)
  for e in np.unique(ids_tk[ids_tk >= 0]):
    tokens, routes = np.nonzero(ids_tk == e)
    gate_fd, up_fd, down_df = split_block(bank_ep[e], ffn_dim, width)
    b_gate, b_up, b_down = (split_biases(bank_ep[e], ffn_dim, width) if bias
                            else (0.0, 0.0, 0.0))
    gate_rf = x_td[tokens] @ gate_fd.T + b_gate
    up_rf = x_td[tokens] @ up_fd.T + b_up
    if activation == "clamped_swiglu":
      hidden_rf = gpt_oss_glu(gate_rf, up_rf, alpha=alpha, limit=limit)
    else:
      hidden_rf = gate_rf / (1.0 + np.exp(-gate_rf)) * up_rf
    out_rd = hidden_rf @ down_df.T + b_down
    np.add.at(y_td, tokens, weights_tk[tokens, routes][:, None] * out_rd)
  return y_td


def quantise_activations(v):
  """A row quantised to int8 as the opt-in int8_activations kernels do, back in float64:
  scale = max|v| / 127, round(v / scale) half to even, times scale (a zero row stays 0)."""
  v = np.asarray(v, np.float64)
  scale = np.max(np.abs(v)) / 127
  return np.round(v / scale) * scale if scale > 0 else np.zeros_like(v)


def routed_experts_quantised(x, ids, weights, bank, layer: int, ffn_dim: int, quantise, *,
                             activation: str = "swiglu", alpha: float = 1.702,
                             limit: float = 7.0, bias: bool = False) -> np.ndarray:
  """``routed_experts`` with each token's x and each route's hidden h passed through
  ``quantise`` (a row to its quantised values, float64) before their products with the weights,
  one route at a time."""
  x_td = np.stack([quantise(row) for row in np.asarray(x)])
  ids_tk, weights_tk = np.asarray(ids), np.asarray(weights, np.float64)
  y_td = np.zeros(x_td.shape)
  for t in range(x_td.shape[0]):
    for k in range(ids_tk.shape[1]):
      if ids_tk[t, k] < 0:
        continue
      block = np.asarray(bank[layer][ids_tk[t, k]])
      gate_fd, up_fd, down_df = split_block(block, ffn_dim, x_td.shape[1])
      b_gate, b_up, b_down = (split_biases(block, ffn_dim, x_td.shape[1]) if bias
                              else (0.0, 0.0, 0.0))
      gate_f, up_f = gate_fd @ x_td[t] + b_gate, up_fd @ x_td[t] + b_up
      if activation == "clamped_swiglu":
        hidden_f = gpt_oss_glu(gate_f, up_f, alpha=alpha, limit=limit)
      else:
        hidden_f = gate_f / (1.0 + np.exp(-gate_f)) * up_f
      y_td[t] += weights_tk[t, k] * (down_df @ quantise(hidden_f) + b_down)
  return y_td


def routed_experts_int8_activations(x, ids, weights, bank, layer: int,
                                    ffn_dim: int) -> np.ndarray:
  """``routed_experts`` of an int8 bank with x and h quantised per row
  (``quantise_activations``), as kernels="ffi_int8" does for int8 experts."""
  return routed_experts_quantised(x, ids, weights, bank, layer, ffn_dim, quantise_activations)


def quantise_blocks(v, block: int = 32):
  """A row quantised per block of ``block`` entries as the int8_activations kernels do for
  mxfp4 banks (llama.cpp's Q8_0 with a float32 scale), back in float64: per block, in float32 as
  the kernel computes it (h rounded to float32 first, as the kernel holds it), scale = max|v| /
  127, q = round(v * (1 / scale)) half to even; then q times the scale."""
  v = np.asarray(v, np.float32)
  out = np.zeros(v.shape)
  for i in range(0, v.size, block):
    scale = np.float32(np.max(np.abs(v[i:i + block]))) / np.float32(127)
    if scale > 0:
      q = np.clip(np.round(v[i:i + block] * (np.float32(1) / scale)), -127, 127)
      out[i:i + block] = q.astype(np.float64) * np.float64(scale)
  return out


def mean_nll(logits, ids) -> float:
  """Mean next-token negative log-likelihood of ``ids`` under ``logits [T, V]`` (row t predicts
  token t + 1), in float64."""
  logits, targets = np.asarray(logits)[:-1].astype(np.float64), np.asarray(ids[1:])
  top = logits.max(-1)
  lse = np.log(np.exp(logits - top[:, None]).sum(-1)) + top
  return float(np.mean(lse - logits[np.arange(len(targets)), targets]))


def _softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def route(logits, *, kind: str, top_k: int, norm_topk_prob: bool, bias=None, n_group: int = 1,
          topk_group: int = 1, scaling: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
  """logits [T, E] -> (weights [T, K] float64, ids [T, K] int64), token by token; ties go to
  the lower expert id. The kinds and options are ``ftjax.model.router.route``'s."""
  logits = np.asarray(logits, np.float64)
  num_experts = logits.shape[-1]
  bias = np.zeros(num_experts) if bias is None else np.asarray(bias, np.float64)
  ids = np.zeros((logits.shape[0], top_k), np.int64)
  weights = np.zeros((logits.shape[0], top_k))
  for t, row in enumerate(logits):
    if kind == "softmax_topk":
      p = _softmax(row)
      order = np.argsort(-p, kind="stable")[:top_k]
      w = p[order]
    elif kind == "topk_softmax":
      order = np.argsort(-row, kind="stable")[:top_k]
      w = _softmax(row[order])
    elif kind == "sigmoid_group":
      scores = 1 / (1 + np.exp(-row))
      biased = scores + bias
      per = num_experts // n_group
      group_score = np.sort(biased.reshape(n_group, per), axis=-1)[:, -2:].sum(-1)
      masked = np.full(num_experts, -np.inf)
      for group in np.argsort(-group_score, kind="stable")[:topk_group]:
        masked[group * per:(group + 1) * per] = biased[group * per:(group + 1) * per]
      order = np.argsort(-masked, kind="stable")[:top_k]
      w = scores[order]
    else:
      raise ValueError(f"unknown router kind {kind!r}")
    if norm_topk_prob and kind != "topk_softmax":
      w = w / w.sum()
    ids[t], weights[t] = order, w * (scaling if kind == "sigmoid_group" else 1.0)
  return weights, ids


def moe_layer(x, router_ed, bank, layer: int, ffn_dim: int, *, top_k: int,
              kind: str = "softmax_topk", norm_topk_prob: bool = False) -> np.ndarray:
  """The routed experts of one MoE layer: x [T, D], router weights [E, D] -> [T, D] float64."""
  x = np.asarray(x, np.float64)
  weights, ids = route(x @ np.asarray(router_ed, np.float64).T, kind=kind, top_k=top_k,
                       norm_topk_prob=norm_topk_prob)
  return routed_experts(x, ids, weights, bank, layer, ffn_dim)


def attention(q, k, v, length: int, *, scale: float, window: int | None = None,
              sinks=None) -> np.ndarray:
  """Queries q [B, T, H, A] against the cache k, v [B, S, G, A]: query t sits at row
  ``length - T + t`` and attends rows ``s <= row`` (and ``s > row - window``); query head h
  uses kv head ``h // (H // G)``; ``sinks`` [H] join each softmax's denominator only.

  Returns [B, T, H, A] float64."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  batch, queries, heads, _ = q.shape
  group = heads // k.shape[2]
  out = np.zeros(q.shape)
  for b in range(batch):
    for t in range(queries):
      row = length - queries + t
      first = 0 if window is None else max(0, row - window + 1)
      for h in range(heads):
        keys, values = k[b, first:row + 1, h // group], v[b, first:row + 1, h // group]
        logits = scale * (keys @ q[b, t, h])
        if sinks is not None:
          logits = np.append(logits, float(sinks[h]))
        p = np.exp(logits - logits.max())
        p /= p.sum()
        out[b, t, h] = p[:len(values)] @ values
  return out
