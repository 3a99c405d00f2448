"""ONNX elementwise ops whose TVM 0.27 converters ignore an attribute or an edge case.

* ``IsInf``: ``detect_positive`` / ``detect_negative`` (0.27 always detects both)::

      Y = (X == +inf) · detect_positive  |  (X == −inf) · detect_negative
* ``BitShift``: a shift outside ``[0, bits)`` (C leaves it undefined; ONNX 1.23 defines it)::

      LEFT:  Y = X << S                      (0 when S < 0 or S ≥ bits)
      RIGHT: Y = X >> S (arithmetic)         (X < 0 ? −1 : 0 when S < 0 or S ≥ bits)
* ``Mod`` with ``fmod=0`` on floats: the sign of the divisor, as numpy (0.27's ``floor_mod``
  computes x − floor(x/y)·y, NaN for an infinite divisor)::

      r = fmod(X, Y);  Y' = r ≠ 0 and sign(r) ≠ sign(Y) ? r + Y : r

  16-bit floats take ``fmod`` in float32 (either ``fmod`` value): CUDA has no half ``fmod``
  (TVM's codegen refuses it) and the remainder is exact, so the cast back changes no bit.
* ``Dropout`` (inference): the optional ``mask`` output is all-True bool (0.27 emits a float).
"""

from __future__ import annotations

import math

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock


def _const(value: float | int, dtype: str) -> relax.Expr:
    return relax.const(value, dtype)


class IsInf(stock.IsInf):
    """``IsInf`` honouring ``detect_positive`` / ``detect_negative``."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x = inputs[0]
        dtype = str(x.ty.dtype)
        pos, neg = attr.get("detect_positive", 1), attr.get("detect_negative", 1)
        found = [relax.op.equal(x, _const(sign * math.inf, dtype))
                 for sign, on in ((1, pos), (-1, neg)) if on]
        if not found:
            return relax.op.zeros_like(x, "bool")
        return found[0] if len(found) == 1 else relax.op.logical_or(*found)


class BitShift(stock.BitShift):
    """``BitShift`` with ONNX's result for shifts outside ``[0, bits)``."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        x, s = inputs[0], inputs[1]
        dtype = str(x.ty.dtype)
        bits = np.dtype(dtype).itemsize * 8
        outside = bb.normalize(relax.op.logical_or(relax.op.less(s, _const(0, dtype)),
                                                   relax.op.greater_equal(s, _const(bits, dtype))))
        safe = relax.op.where(outside, _const(0, dtype), s)
        left = attr.get("direction", b"LEFT").decode("ascii") == "LEFT"
        shifted = (relax.op.left_shift if left else relax.op.right_shift)(x, safe)
        if left or dtype.startswith("uint"):
            fill = _const(0, dtype)
        else:
            fill = relax.op.right_shift(x, _const(bits - 1, dtype))
        return relax.op.where(outside, fill, shifted)


def _fmod(x: relax.Expr, y: relax.Expr, dtype: str) -> relax.Expr:
    """Truncated remainder (the dividend's sign) of floats; 16-bit ones computed in float32."""
    if dtype not in _HALF:
        return relax.op.mod(x, y)
    wide = relax.op.mod(relax.op.astype(x, "float32"), relax.op.astype(y, "float32"))
    return relax.op.astype(wide, dtype)


_HALF = ("float16", "bfloat16")


class Mod(stock.Mod):
    """``Mod``: floats with ``fmod=0`` take the divisor's sign, infinite divisors included."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x, y = inputs[0], inputs[1]
        dtype = str(x.ty.dtype)
        if not dtype.startswith(("float", "bfloat")):
            return super()._impl_v10(bb, inputs, attr, params)
        if attr.get("fmod", 0):
            return _fmod(x, y, dtype) if dtype in _HALF else super()._impl_v10(bb, inputs, attr,
                                                                                params)
        r = bb.normalize(_fmod(x, y, dtype))
        zero = _const(0.0, dtype)
        # logical_xor: not_equal of two bool tensors miscompiles on llvm (fcmp on i1)
        flip = relax.op.logical_and(relax.op.not_equal(r, zero),
                                    relax.op.logical_xor(relax.op.less(r, zero),
                                                         relax.op.less(y, zero)))
        return relax.op.where(flip, relax.op.add(r, y), r)


class Dropout(stock.Dropout):
    """Inference ``Dropout``: ``Y = X`` and, when asked for, an all-True bool ``mask``."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        if attr["tvm_custom"]["num_outputs"] < 2:
            return super()._impl_v12(bb, inputs, attr, params)
        return relax.Tuple([inputs[0], bb.normalize(relax.op.ones_like(inputs[0], "bool"))])
