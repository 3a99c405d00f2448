"""ONNX ``QLinearConv`` (opset 10), as onnx's reference computes it::

    acc = conv(X − x_zp, W − w_zp) + B                     (w_zp, w_scale per channel when 1-D)
    Y = saturate(rint(acc · (x_scale·w_scale / y_scale) + y_zp))
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._quant import F64, out_dtype, requantize, scale_ratio
from .conv_integer import integer_conv


class QLinearConv(stock.OnnxOpConverter):
    """``QLinearConv`` with per-tensor or per-output-channel weight quantization."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x, x_s, x_zp, w, w_s, w_zp, y_s, y_zp, bias = (list(inputs) + [None] * 9)[:9]
        acc = integer_conv(bb, x, w, x_zp, w_zp, attr, params)
        spatial = x.ty.ndim - 2
        if bias is not None:
            wide = bb.normalize(relax.op.astype(bias, F64))
            acc = relax.op.add(acc, relax.op.reshape(wide, [-1] + [1] * spatial))
        if w_s.ty.ndim == 1:
            w_s = relax.op.reshape(w_s, [-1] + [1] * spatial)
        return requantize(acc, scale_ratio(x_s, w_s, y_s), y_zp, out_dtype(y_zp, x))
