"""passes/weight_arrays.py: the torch-backed weight arithmetic equals numpy's float64 reference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tvmfuse.passes import weight_arrays as wa

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("gamma_dtype", ["float16", "float32"])
def test_scale_rows_is_one_rounding_of_the_exact_product(gamma_dtype):
    """fp16 γ·W in fp32 equals the float64 product rounded once (and on a transposed view)."""
    w = RNG.standard_normal((96, 64)).astype(np.float16)  # (N, K) storage as torch keeps it
    gamma = (1 + RNG.standard_normal(64)).astype(np.float16).astype(gamma_dtype)
    want = (gamma.astype(np.float64)[:, None] * w.T.astype(np.float64)).astype(np.float16)
    got = wa.scale_rows(gamma, w.T)
    assert got.flags.c_contiguous and got.dtype == np.float16
    assert np.array_equal(got, want)


def test_scale_rows_fp32_gamma_not_half_uses_float64():
    w = RNG.standard_normal((32, 16)).astype(np.float16)
    gamma = RNG.standard_normal(32).astype(np.float32)  # not representable in fp16
    want = (gamma.astype(np.float64)[:, None] * w.astype(np.float64)).astype(np.float16)
    assert np.array_equal(wa.scale_rows(gamma, w), want)


def test_views_and_joins():
    a = RNG.standard_normal((8, 6)).astype(np.float16)
    b = RNG.standard_normal((8, 6)).astype(np.float16)
    assert np.array_equal(wa.transpose(a), a.T)
    assert np.array_equal(wa.concatenate([a, b], 1), np.concatenate([a, b], 1))
    inter = wa.interleave_columns(a, b)
    assert np.array_equal(inter[:, 0::2], a) and np.array_equal(inter[:, 1::2], b)
    assert wa.equal(a.T, np.ascontiguousarray(a.T)) and not wa.equal(a, b)


@pytest.mark.parametrize("dtype", ["float16", "float32", "int64", "bool", "bfloat16"])
def test_constant_round_trip(dtype):
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    arr = (RNG.standard_normal((64, 64)) * 4).astype(np_dtype)
    const = wa.constant(arr)
    back = wa.array(const)
    assert str(const.value.dtype) == dtype and np.array_equal(back, arr)
    if dtype != "bfloat16":  # a view of the constant's memory, read-only
        assert not back.flags.writeable
