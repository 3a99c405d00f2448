"""ONNX ``QLinearMatMul`` (opset 10 / 21), as onnx's reference computes it::

    Y = saturate(rint((A − a_zp)·(B − b_zp) · (a_scale·b_scale / y_scale) + y_zp))

The integer product in float64 (exact), the scale ratio in the scales' dtype; Y has y_zp's type.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._quant import centred, out_dtype, requantize, scale_ratio


class QLinearMatMul(stock.OnnxOpConverter):
    """``QLinearMatMul`` with per-tensor scales and zero points."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp = (list(inputs) + [None] * 8)[:8]
        acc = relax.op.matmul(centred(bb, a, a_zp), centred(bb, b, b_zp))
        return requantize(acc, scale_ratio(a_s, b_s, y_s), y_zp, out_dtype(y_zp, a))
