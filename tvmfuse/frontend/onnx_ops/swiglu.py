"""ONNX ``SwiGLU`` (opset 28): the gated linear unit of LLaMA-style MLPs::

    Y = Swish_alpha(A) · B = A · sigmoid(alpha · A) · B       A, B the same shape, alpha default 1.0
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape
from .swish import swish


class SwiGLU(stock.OnnxOpConverter):
    """``SwiGLU`` → ``swish(A, alpha) · B`` (elementwise; ONNX does not broadcast A and B)."""

    @classmethod
    def _impl_v28(cls, bb, inputs, attr, params):
        a, b = inputs[0], inputs[1]
        if static_shape(a) != static_shape(b) or str(a.ty.dtype) != str(b.ty.dtype):
            raise ValueError(f"SwiGLU: A {a.ty} and B {b.ty} must have the same shape and dtype")
        return relax.op.multiply(swish(a, float(attr.get("alpha", 1.0))), b)
