"""The suite's numeric tolerances, in one place (STYLE.md section 8), and the helper applying them.

``assert_close(got, ref, tol)`` checks ``max |got - ref| <= tol · max |ref|``; with
``floor=1.0`` the scale is ``max(1, max |ref|)`` (logits and router weights, which may all be
small). References are float64 (``reference.py``) computed from the same, already rounded
weights, so a tolerance covers only the arithmetic of the path under test. Never loosen one to
make a test pass: find out why it fails.
"""

from __future__ import annotations

import numpy as np

# float32 paths, relative to the reference's scale.
F32 = 1e-5  # float32 products and sums (any order, any kernel) vs float64 or another order
F32_ROUNDING = 1e-6  # a few float32 roundings of one value (a division, a softmax, a cast)
BF16_ACTIVATIONS = 1e-2  # activations rounded to bfloat16 (2^-9 each) for vdpbf16ps products
BF16_KV_CACHE = 1e-2  # attention over a bfloat16 KV cache vs the float32 one (k, v: 2^-9 each)
HF_PARITY = 1e-4  # transformers' float32 eager forward: other op order, fused ops, 2 layers

# float64 paths (the cost model, replay statistics), relative unless they say otherwise.
F64 = 1e-12  # a float64 sum of a few terms vs the value computed by hand
F64_DIFFERENCE = 1e-9  # the difference of two float64 times: the cancellation loses digits


def assert_close(got, ref, tol: float, *, floor: float = 0.0, what: str = "") -> None:
  """Asserts ``max |got - ref| <= tol · max(floor, max |ref|)``; equal shapes, no NaN."""
  got, ref = np.asarray(got), np.asarray(ref)
  assert got.shape == ref.shape, (what, got.shape, ref.shape)
  scale = max(floor, float(np.max(np.abs(ref))))
  assert scale > 0, "a test that expects zeros should compare exactly"
  error = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
  assert error <= tol * scale, (
      f"{what + ': ' if what else ''}max |got - ref| = {error:.3g} exceeds {tol:g} * "
      f"{scale:.3g}")
