"""Integer arithmetic shared by the quantized ONNX converters (QLinearMatMul, ConvInteger,
QLinearConv): integer operands are widened to float64, where every int8/uint8 product sum of
fewer than 2³⁷ terms is exact, and results rounded half to even and saturated."""

from __future__ import annotations

import numpy as np
from tvm import relax

from ._common import dtype_of

F64 = "float64"


def centred(bb: relax.BlockBuilder, x: relax.Expr, zero_point: relax.Expr | None,
            channel_axis: int | None = None) -> relax.Expr:
    """``float64(x) − float64(zero_point)``; a 1-D ``zero_point`` of x's ``channel_axis`` length is
    per channel (reshaped to broadcast along that axis)."""
    wide = relax.op.astype(x, F64)
    if zero_point is None:
        return wide
    zp = bb.normalize(relax.op.astype(zero_point, F64))
    if channel_axis is not None and zero_point.ty.ndim == 1:
        ndim = x.ty.ndim
        zp = relax.op.reshape(zp, [-1] + [1] * (ndim - channel_axis - 1))
    return relax.op.subtract(wide, zp)


def requantize(acc: relax.Expr, multiplier: relax.Expr, zero_point: relax.Expr | None,
               dtype: str) -> relax.Expr:
    """``saturate(rint(acc · multiplier + zero_point))`` as ``dtype`` (an 8-bit integer type)."""
    y = relax.op.multiply(acc, relax.op.astype(multiplier, F64))
    if zero_point is not None:
        y = relax.op.add(y, relax.op.astype(zero_point, F64))
    info = np.iinfo(dtype)
    y = relax.op.clip(relax.op.round(y), float(info.min), float(info.max))
    return relax.op.astype(y, dtype)


def scale_ratio(a: relax.Expr, b: relax.Expr, y: relax.Expr) -> relax.Expr:
    """``a · b / y`` in the scales' own dtype (as onnx's reference rounds it), b broadcast per
    channel when 1-D."""
    return relax.op.divide(relax.op.multiply(a, b), y)


def out_dtype(zero_point: relax.Expr | None, fallback: relax.Expr) -> str:
    return dtype_of(zero_point if zero_point is not None else fallback)
