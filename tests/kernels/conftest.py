"""Shared by the kernel tests: the tolerance check by compute dtype, and the ISA fixture.

The tolerances are the suite's (``tests/tolerances.py``): max |y - ref| <= limit * max |ref|,
with the reference in float64 computed from the same (bf16-rounded) weights widened exactly
(``tests/reference.py`` for the experts). The limit is by the dtype the products are computed
in:
- float32: ``F32``. float32 weights, or bf16 weights widened to float32 (exact products): what
  is left is float32 accumulation.
- bfloat16: ``BF16_ACTIVATIONS``. bf16 weights with bf16_activations=True on an AVX-512-BF16
  CPU: the kernels round the activations (x, and the expert's hidden h) to bf16 and multiply
  with vdpbf16ps; each rounding is up to 2^-9 relative.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.kernels import cpu_info

import tolerances

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)

RELATIVE_LIMIT = {F32: tolerances.F32, BF16: tolerances.BF16_ACTIVATIONS}

ISAS = ("scalar", "avx2", "avx512", "avx512bf16")


def compute_dtype(weight_dtype, bf16_activations=False):
  """The dtype the kernels multiply in: bf16 only for bf16 weights with bf16 activations (the
  ISAs without AVX-512-BF16 widen instead and are held to the float32 limit regardless)."""
  return BF16 if np.dtype(weight_dtype) == BF16 and bf16_activations else F32


def check_close(y, ref, weight_dtype, bf16_activations=False):
  """Asserts y is float32 and max |y - ref| <= RELATIVE_LIMIT[compute dtype] * max |ref|."""
  y = np.asarray(y)
  assert y.dtype == np.float32
  tolerances.assert_close(y, ref, RELATIVE_LIMIT[compute_dtype(weight_dtype, bf16_activations)])


@pytest.fixture
def assert_close():
  return check_close


@pytest.fixture(params=[False, True], ids=["exact", "bf16_activations"])
def bf16_activations(request):
  return request.param


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
  """Runs the test once per instruction set (FTJAX_ISA); skips those this CPU lacks."""
  monkeypatch.setenv("FTJAX_ISA", request.param)
  info = cpu_info()
  if info["isa"] != request.param:
    pytest.skip(f"this CPU does not support {request.param} (its best is {info['best_isa']})")
  return request.param
