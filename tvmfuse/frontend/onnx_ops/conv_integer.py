"""ONNX ``ConvInteger`` (opset 10)::

    Y = int32(conv(X − x_zp, W − w_zp))          w_zp per output channel when 1-D

TVM's ``Conv`` converter (pads, auto_pad, strides, dilations, group) on the centred operands in
float64, exact for 8-bit inputs.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._quant import centred


def integer_conv(bb, x: relax.Expr, w: relax.Expr, x_zp: relax.Expr | None, w_zp: relax.Expr | None,
                 attr: dict, params) -> relax.Expr:
    """``conv(X − x_zp, W − w_zp)`` in float64 (``attr``: the ONNX Conv attributes)."""
    xs, ws = bb.normalize(centred(bb, x, x_zp)), bb.normalize(centred(bb, w, w_zp, channel_axis=0))
    return stock.Conv._impl_v11(bb, [xs, ws, None], dict(attr), params)


class ConvInteger(stock.OnnxOpConverter):
    """``ConvInteger`` → int32."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x, w, x_zp, w_zp = (list(inputs) + [None] * 4)[:4]
        return relax.op.astype(integer_conv(bb, x, w, x_zp, w_zp, attr, params), "int32")
