"""ONNX ``Pow`` (opset 7+) for the mixed and integer types 0.27 fails on (its ``R.power`` needs one
dtype, and integer ``power`` does not legalize). The result has X's type, as numpy's
``power(X, Y).astype(X.dtype)`` in onnx's reference::

    float X, float Y of X's type:  TVM's converter
    integer X, integer Y:          square-and-multiply over Y's bits, wrapping like numpy
                                   (Y < 0: 1 for X = 1, ±1 for X = −1, else 0: C's truncation)
    otherwise:                     cast(power(float64(X), float64(Y)), X.dtype)
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._common import dtype_of


def _int_pow(bb: relax.BlockBuilder, x: relax.Expr, y: relax.Expr) -> relax.Expr:
    """``x ** y`` for integer tensors, exact modulo 2^bits of x's dtype."""
    xt, yt = dtype_of(x), dtype_of(y)
    one, zero = relax.const(1, xt), relax.const(0, yt)
    e = bb.normalize(relax.op.maximum(y, zero)) if not yt.startswith("uint") else y
    result, base = relax.op.ones_like(x), x
    for _ in range(np.dtype(yt).itemsize * 8):
        odd = relax.op.not_equal(relax.op.bitwise_and(e, relax.const(1, yt)), zero)
        result = bb.normalize(relax.op.where(odd, relax.op.multiply(result, base), result))
        base = bb.normalize(relax.op.multiply(base, base))
        e = bb.normalize(relax.op.right_shift(e, relax.const(1, yt)))
    if yt.startswith("uint"):
        return result
    odd_y = relax.op.not_equal(relax.op.bitwise_and(y, relax.const(1, yt)), zero)
    minus_one = relax.op.where(odd_y, relax.const(-1, xt) if not xt.startswith("uint") else one, one)
    negative = relax.op.where(relax.op.equal(x, one), one,
                              relax.op.where(relax.op.equal(x, relax.op.negative(one)), minus_one,
                                             relax.const(0, xt)))
    return relax.op.where(relax.op.less(y, zero), negative, result)


class Pow(stock.Pow):
    """``Pow`` with integer and mixed-type operands (see the module docstring)."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        x, y = inputs
        if not all(isinstance(v, relax.Expr) and isinstance(v.ty, relax.TensorType) for v in inputs):
            return super()._impl_v7(bb, inputs, attr, params)
        xt, yt = dtype_of(x), dtype_of(y)
        is_int = [t.startswith(("int", "uint")) for t in (xt, yt)]
        if xt == yt and not is_int[0]:
            return super()._impl_v7(bb, inputs, attr, params)
        if all(is_int):
            return _int_pow(bb, x, y)
        wide = relax.op.power(relax.op.astype(x, "float64"), relax.op.astype(y, "float64"))
        return relax.op.astype(wide, xt)
