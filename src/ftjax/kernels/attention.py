"""Host attention over a KV cache, for decode and prefill chunks: the XLA FFI op
`ftjax_attention` (xla_ffi/attention.cc).

    out[b, t, h] = softmax_s(scale · q[b, t, h] · k[b, s, h // R] [, sinks[h]]) · v[b, s, h // R]

for queries q [B, T, H, A] against the cache k, v [B, S, G, A] (R = H / G query heads per kv
head). The cache already holds this step's keys: query t sits at row ``length - T + t`` and
attends the rows up to its own (causal), with a sliding ``window`` only the last ``window`` of
them; rows from ``length`` on are never read. ``sinks`` [H] are learned logits that join each
head's softmax denominator but carry no value.

The cache is float32 or bfloat16 (k and v alike, widened exactly in the kernel), a bfloat16 one
possibly as its bits, uint16 (``ftjax.model.layers.KV_BITS``, how the engine holds it: XLA:CPU
writes rows into a uint16 buffer in place); queries, the softmax and the accumulation are
float32.

Why an op: inside the decode loop (a ``lax.while_loop``) XLA:CPU's einsum attention over the
loop-carried cache copies and transposes all of K and V at every step. This op reads the cache
in place in its own layout, so a cache updated by ``dynamic_update_slice`` of a donated buffer
is neither copied nor transposed; each K and V row is read once for all R heads of its group and
all T queries, with an online softmax. Prefill chunks (T up to thousands) run as a blocked flash
attention that skips the blocks masked for a whole tile of queries (the causal upper triangle,
rows before the window): ~half of T x length for a causal chunk, ~T x window with a window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels._registration import require, shape_and_dtype

# The dtypes of the KV cache: k and v share one (uint16: bfloat16 bits).
KV_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.uint16))


def attention(q, k, v, length, *, scale, window=None, sinks=None):
  """Attention of T queries per sequence against the first ``length`` rows of a KV cache.

  Args:
    q: [B, T, H, A] float32 queries (rotary embedding applied, not scaled).
    k: [B, S, G, A] key cache, float32, bfloat16 or uint16 holding bfloat16 bits (read as is,
      widened exactly to float32 in the kernel), G dividing H; query head h uses kv head
      h // (H / G).
    v: [B, S, G, A] value cache, k's dtype.
    length: int32 scalar (array or Python int; may be traced): the number of valid cache rows,
      this step's T included, in [T, S]; or int32 [B], one per sequence (a batch at different
      positions: one call, each sequence against its own rows). A concrete value is checked
      here, a traced one by the kernel at run time.
    scale: the factor of the scores q · k (usually A ** -0.5); a Python number.
    window: None, or a positive int w: query row i attends only rows s > i - w.
    sinks: None, or [H] float32 per-head sink logits.

  Returns:
    out: [B, T, H, A] float32 (float32 accumulation, also for a bfloat16 cache).

  Raises:
    ValueError: naming the argument whose shape, dtype or value is wrong.

  Under jax.vmap the calls run one after the other.
  """
  q_shape, q_dtype = shape_and_dtype("q", q)
  k_shape, k_dtype = shape_and_dtype("k", k)
  v_shape, v_dtype = shape_and_dtype("v", v)
  if len(q_shape) != 4 or q_dtype != np.float32:
    raise ValueError(f"q must be float32 [B, T, H, A], got {q_dtype} of shape {q_shape}")
  B, T, H, A = q_shape
  if len(k_shape) != 4 or k_dtype not in KV_DTYPES or k_shape[0] != B or k_shape[3] != A:
    raise ValueError(f"k must be float32, bfloat16 or uint16 (bfloat16 bits) [B, S, G, A] with "
                     f"B = {B} and A = {A} from "
                     f"q, got {k_dtype} of shape {k_shape}")
  S, G = k_shape[1], k_shape[2]
  if G == 0 or H % G != 0:
    raise ValueError(f"k's kv heads G = {G} must divide q's heads H = {H}")
  if v_shape != k_shape:
    raise ValueError(f"v must have k's shape {k_shape}, got {v_dtype} of shape {v_shape}")
  if v_dtype != k_dtype:
    raise ValueError(f"v must have k's dtype {k_dtype} (one cache dtype for both: cast one, e.g. "
                     f"v.astype(k.dtype)), got {v_dtype}")
  length = _checked_length(length, T, S, B)
  if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.number)):
    raise ValueError(f"scale must be a Python or numpy number, got {scale!r}")
  if window is not None and (isinstance(window, (bool, np.bool_))
                             or not isinstance(window, (int, np.integer)) or window < 1):
    raise ValueError(f"window must be None or a positive int, got {window!r}")
  if sinks is None:
    sinks_h = jnp.zeros((0,), jnp.float32)
  else:
    sinks_shape, sinks_dtype = shape_and_dtype("sinks", sinks)
    if sinks_shape != (H,) or sinks_dtype != np.float32:
      raise ValueError(f"sinks must be float32 [H] with H = {H} from q, got {sinks_dtype} of "
                       f"shape {sinks_shape}")
    sinks_h = sinks
  require("attention")
  call = jax.ffi.ffi_call(
    "ftjax_attention",
    jax.ShapeDtypeStruct(q_shape, jnp.float32),
    vmap_method="sequential",
  )
  return call(q, k, v, length, sinks_h, scale=np.float32(scale),
              window=np.int64(0 if window is None else window), use_sinks=sinks is not None)


def _checked_length(length, T, S, B):
  """length as an int32 scalar or [B]; its range checked when it is known at trace time."""
  if isinstance(length, (bool, np.bool_)):
    raise ValueError(f"length must be an int32 scalar or [B], got {length!r}")
  if isinstance(length, (int, np.integer)):
    value = int(length)
    if not T <= value <= S:
      raise ValueError(f"length must be in [T, S] = [{T}, {S}], got {value}")
    return np.int32(value)
  shape, dtype = shape_and_dtype("length", length)
  if shape not in ((), (B,)) or dtype != np.int32:
    raise ValueError(f"length must be an int32 scalar or [B] with B = {B}, got {dtype} of shape "
                     f"{shape}")
  if not isinstance(length, jax.core.Tracer):
    values = np.asarray(length).reshape(-1)
    bad = values[(values < T) | (values > S)]
    if bad.size:
      raise ValueError(f"length must be in [T, S] = [{T}, {S}], got {int(bad[0])}")
  return length
