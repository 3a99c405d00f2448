"""Compile-time arithmetic on weight constants, fast enough for 7B-class models.

The passes that fold a norm's γ into the next GEMM, concatenate Q/K/V, interleave gate/up and
transpose weights for the decode GEMV touch every weight of the model (13.5 GB for Llama-2-7B).
numpy does that on one core, and fp16 arithmetic element by element; torch's CPU kernels (when
torch is installed, as it is for every torch model) are vectorised and use every core, so the
work goes there, with numpy as the fallback. Constants are read and made through DLPack, without
a copy, where the memory allows it (contiguous, 64-byte aligned).

Exactness: ``scale_rows`` multiplies in fp32 when both factors are 16-bit floats (the product of two
11-bit significands fits fp32's 24 bits: one rounding, to the weight's dtype, as in fp64) and in
fp64 otherwise.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import ModuleType

import numpy as np
import tvm
from tvm import relax

_HALF = ("float16", "bfloat16")
_ALIGN = 64  # TVM's allocation alignment: from_dlpack refuses less


@functools.cache
def _torch() -> ModuleType | None:
    try:
        import torch
    except ImportError:  # numpy only
        return None
    return torch


def _as_torch(arr: np.ndarray):
    """``arr`` as a torch tensor sharing its memory (any strides), or None."""
    torch = _torch()
    if torch is None or arr.dtype.name not in ("float16", "float32", "float64"):
        return None
    with warnings.catch_warnings():  # read-only arrays: only read here, torch warns anyway
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def array(const: relax.Constant) -> np.ndarray:
    """A constant's value as numpy, sharing the constant's memory (read-only) where DLPack
    allows, else a copy."""
    data = const.value
    try:
        arr = np.from_dlpack(data)
    except (BufferError, TypeError, RuntimeError, ValueError):  # bfloat16, bool, non-CPU
        return data.numpy()
    arr.flags.writeable = False
    return arr


def constant(arr: np.ndarray) -> relax.Constant:
    """``relax.const(arr)``, without a copy when ``arr`` is contiguous and aligned (the
    constant keeps ``arr`` alive)."""
    if arr.flags.c_contiguous and arr.ctypes.data % _ALIGN == 0 and arr.size:
        try:
            return relax.const(tvm.runtime.from_dlpack(arr))
        except Exception:  # noqa: BLE001 - dtypes DLPack cannot carry (bfloat16 numpy): copy
            pass
    return relax.const(arr, str(arr.dtype))  # (without a dtype, relax.const narrows int64/float64)


def identity(*arrays: np.ndarray) -> tuple:
    """A dict key naming arrays by their memory: views of a module's constants (:func:`array`) are
    named by the constant while the module holds it; a memo holding the arrays keeps it so."""
    return tuple((a.ctypes.data, a.shape, a.strides, a.dtype.str) for a in arrays)


class DerivedConstants:
    """Constants computed from weights, each made once per ``key`` (a pass shares one memo across
    its functions, so prefill and decode entry points get the same constant object and the
    weights file holds it once). ``key`` names the sources: a constant's ``hash`` (the module
    holds it) or :func:`identity` of views of its memory, which ``keep`` then holds alive so the
    address cannot name another array while the memo lives."""

    def __init__(self) -> None:
        self._made: dict = {}

    def get(self, key, make: Callable[[], np.ndarray], keep: object = None) -> relax.Constant:
        """The constant of ``make()`` for ``key``, made on the first request."""
        if key not in self._made:
            self._made[key] = (constant(make()), keep)
        return self._made[key][0]


def transpose(w: np.ndarray) -> np.ndarray:
    """``w.T`` of a 2-D array, contiguous."""
    t = _as_torch(w)
    if t is None:
        return np.ascontiguousarray(w.T)
    return t.t().contiguous().numpy()


def concatenate(parts: list[np.ndarray], axis: int) -> np.ndarray:
    """``np.concatenate(parts, axis)`` (parts of one dtype)."""
    ts = [_as_torch(p) for p in parts]
    if any(t is None for t in ts) or len({p.dtype for p in parts}) != 1:
        return np.concatenate(parts, axis=axis)
    return _torch().cat(ts, dim=axis).numpy()


def interleave_columns(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(K, N) and (K, N) → (K, 2N) with columns a₀ b₀ a₁ b₁ …"""
    ta, tb = _as_torch(a), _as_torch(b)
    if ta is None or tb is None or a.dtype != b.dtype:
        return np.stack([a, b], axis=2).reshape(a.shape[0], 2 * a.shape[1])
    return _torch().stack([ta, tb], dim=2).reshape(a.shape[0], 2 * a.shape[1]).numpy()


def _fits_half(gamma: np.ndarray, dtype: str) -> bool:
    if gamma.dtype.name == dtype:
        return True
    if gamma.dtype.name != "float32" or dtype != "float16":
        return False
    return bool(np.array_equal(gamma.astype(np.float16).astype(np.float32), gamma))


def scale_rows(gamma: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``γ[:, None] · W`` rounded once to W's dtype; γ (K,), W (K, N) (any strides)."""
    dtype = w.dtype.name
    tw, tg = _as_torch(w), _as_torch(np.ascontiguousarray(gamma.reshape(-1)))
    if dtype in _HALF and _fits_half(gamma, dtype) and tw is not None and tg is not None:
        prod = tw.float() * tg.float().reshape(-1, 1)
        return prod.to(tw.dtype).contiguous().numpy()
    prod = gamma.astype(np.float64).reshape(-1, 1) * w.astype(np.float64)
    return prod.astype(w.dtype)


def equal(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal(a, b)`` (any strides)."""
    ta, tb = _as_torch(a), _as_torch(b)
    if ta is None or tb is None or a.dtype != b.dtype or a.shape != b.shape:
        return bool(np.array_equal(a, b))
    return bool(_torch().equal(ta, tb))
