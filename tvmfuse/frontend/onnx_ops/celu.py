"""ONNX ``Celu`` (opset 12) and ``Elu`` in the input's dtype (0.27's ``Elu`` mixes float32
constants into a float16 / bfloat16 graph and fails; ``Celu``'s function expansion calls it)::

    Elu(x)  = max(0, x) + min(0, α·(exp(x) − 1))
    Celu(x) = max(0, x) + min(0, α·(exp(x/α) − 1))

Half-precision inputs are computed in float32 and cast back.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._common import dtype_of

_F32 = "float32"


def _elu(x: relax.Expr, alpha: float, scale_input: bool) -> relax.Expr:
    dtype = dtype_of(x)
    x32 = x if dtype == _F32 else relax.op.astype(x, _F32)
    arg = relax.op.divide(x32, relax.const(alpha, _F32)) if scale_input else x32
    neg = relax.op.multiply(relax.const(alpha, _F32),
                            relax.op.subtract(relax.op.exp(arg), relax.const(1.0, _F32)))
    y = relax.op.add(relax.op.maximum(x32, relax.const(0.0, _F32)),
                     relax.op.minimum(neg, relax.const(0.0, _F32)))
    return y if dtype == _F32 else relax.op.astype(y, dtype)


class Elu(stock.Elu):
    """``Elu`` in the input's dtype."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return _elu(inputs[0], float(attr.get("alpha", 1.0)), scale_input=False)


class Celu(stock.OnnxOpConverter):
    """``Celu`` (``alpha`` default 1)."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        return _elu(inputs[0], float(attr.get("alpha", 1.0)), scale_input=True)
