"""ONNX ``Swish`` (opset 24)::

    Y = X · sigmoid(alpha · X)          X any float shape, alpha default 1.0

With ``alpha == 1`` this is ``x · sigmoid(x)`` (SiLU), the form the elementwise fusion sees from
torch. :func:`swish` is shared with ``SwiGLU`` and ``CausalConvWithState``'s fused activation.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock


def swish(x: relax.Expr, alpha: float = 1.0) -> relax.Expr:
    """``x · sigmoid(alpha · x)`` in ``x``'s dtype."""
    dtype = str(x.ty.dtype)
    gate = x if alpha == 1.0 else relax.op.multiply(x, relax.const(alpha, dtype))
    return relax.op.multiply(x, relax.op.sigmoid(gate))


class Swish(stock.OnnxOpConverter):
    """``Swish`` → ``x · sigmoid(alpha · x)``."""

    @classmethod
    def _impl_v24(cls, bb, inputs, attr, params):
        return swish(inputs[0], float(attr.get("alpha", 1.0)))
