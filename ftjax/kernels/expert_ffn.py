"""Host SwiGLU expert FFN: the XLA FFI op `ftjax_expert_ffn` (C++ in xla_ffi/expert_ffn.cc).

For tokens x [T, D], routes ids [T, K] (-1 skips a route) with weights [T, K], and one
layer of an expert bank [L, E, P]:

    y[t] = sum_k weights[t, k] * down_e(silu(gate_e @ x[t]) * (up_e @ x[t])),  e = ids[t, k]

Each expert block bank[layer, e] holds, row-major and contiguous, gate [F, D] at element
offset 0, up [F, D] at F*D and down [D, F] at 2*F*D; P >= 3*F*D and the rest is padding.
The kernel accumulates in float32 and returns float32.

Importing this module registers every handler of ftjax's compiled module with XLA:CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

try:
  import ftjax._ffi as _ffi
except ImportError as error:
  raise ImportError(
    "ftjax's compiled module ftjax._ffi is missing. ftjax must be installed with "
    "`pip install --no-build-isolation .` (after installing jax, scikit-build-core and "
    "nanobind), which builds the C++ kernels in xla_ffi/. Running from a source checkout "
    "without installing does not work."
  ) from error

for _name, _capsule in _ffi.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
del _name, _capsule

_BANK_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32))


def expert_ffn(x, ids, weights, bank, layer, *, ffn_dim):
  """Weighted sum of the routed SwiGLU experts of one layer, on the host.

  Args:
    x: [T, D] float32 tokens.
    ids: [T, K] int32 expert ids in [-1, E); -1 skips the route. Values are checked by
      the kernel at run time (they may be traced).
    weights: [T, K] float32 route weights.
    bank: [L, E, P] bfloat16 or float32 expert blocks (may be traced).
    layer: int32 scalar in [0, L) (may be traced; checked here when concrete and by the
      kernel at run time).
    ffn_dim: F, the expert hidden width; a static Python int.

  Returns:
    y: [T, D] float32.

  Raises:
    ValueError: naming the argument whose shape, dtype or value is wrong.
  """
  x_shape, x_dtype = _shape_and_dtype("x", x)
  ids_shape, ids_dtype = _shape_and_dtype("ids", ids)
  weights_shape, weights_dtype = _shape_and_dtype("weights", weights)
  bank_shape, bank_dtype = _shape_and_dtype("bank", bank)

  if len(x_shape) != 2:
    raise ValueError(f"x must be 2-D [T, D], got shape {x_shape}")
  if x_dtype != np.float32:
    raise ValueError(f"x must be float32, got {x_dtype}")
  T, D = x_shape

  if len(ids_shape) != 2 or ids_shape[0] != T:
    raise ValueError(f"ids must be [T, K] with T = {T} from x, got shape {ids_shape}")
  if ids_dtype != np.int32:
    raise ValueError(f"ids must be int32, got {ids_dtype}")

  if weights_shape != ids_shape:
    raise ValueError(f"weights must be [T, K] = {ids_shape} like ids, got shape {weights_shape}")
  if weights_dtype != np.float32:
    raise ValueError(f"weights must be float32, got {weights_dtype}")

  if len(bank_shape) != 3:
    raise ValueError(f"bank must be 3-D [L, E, P], got shape {bank_shape}")
  if bank_dtype not in _BANK_DTYPES:
    raise ValueError(f"bank must be bfloat16 or float32, got {bank_dtype}")
  L, _, P = bank_shape

  if isinstance(ffn_dim, (bool, np.bool_)) or not isinstance(ffn_dim, (int, np.integer)):
    raise ValueError(f"ffn_dim must be a Python int, got {ffn_dim!r}")
  if ffn_dim <= 0:
    raise ValueError(f"ffn_dim must be positive, got {ffn_dim}")
  if P < 3 * ffn_dim * D:
    raise ValueError(
      f"bank's last dimension P = {P} is smaller than 3 * ffn_dim * D = 3 * {ffn_dim} * {D}"
    )

  _check_layer(layer, L)

  call = jax.ffi.ffi_call(
    "ftjax_expert_ffn",
    jax.ShapeDtypeStruct(x_shape, jnp.float32),
    vmap_method="sequential",
  )
  return call(x, ids, weights, bank, jnp.asarray(layer, jnp.int32), ffn_dim=np.int64(ffn_dim))


def _shape_and_dtype(name, array):
  try:
    return tuple(array.shape), np.dtype(array.dtype)
  except AttributeError:
    raise ValueError(f"{name} must be an array, got {type(array).__name__}") from None


def _check_layer(layer, num_layers):
  """Checks that `layer` is an integer scalar, and in [0, L) when its value is known."""
  if isinstance(layer, (bool, np.bool_)):
    raise ValueError(f"layer must be an integer scalar, got {layer!r}")
  if isinstance(layer, (int, np.integer)):
    value = int(layer)
  else:
    shape, dtype = _shape_and_dtype("layer", layer)
    if shape != () or not np.issubdtype(dtype, np.integer):
      raise ValueError(f"layer must be an integer scalar, got shape {shape} dtype {dtype}")
    if not isinstance(layer, np.ndarray):
      return  # a jax value, possibly traced: the kernel checks it at run time
    value = int(layer)
  if not 0 <= value < num_layers:
    raise ValueError(f"layer = {value} is outside [0, L) with L = {num_layers}")
