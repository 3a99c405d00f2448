"""ONNX ``BitCast`` (opset 26, absent in TVM 0.27): the same bits read as another element type
of the same width, elementwise, same shape::

    Y[i] = reinterpret<to>(X[i])          (bool ↔ 8-bit: the 0 / 1 byte, a plain cast)
"""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock


def _bits(dtype: str) -> int:
    if dtype in ("bool", "bfloat16"):
        return 8 if dtype == "bool" else 16
    return np.dtype(dtype).itemsize * 8


class BitCast(stock.OnnxOpConverter):
    """``BitCast`` to the ``to`` element type of the input's width."""

    @classmethod
    def _impl_v26(cls, bb, inputs, attr, params):
        from onnx import helper

        x = inputs[0]
        src, dst = str(x.ty.dtype), helper.tensor_dtype_to_np_dtype(attr["to"]).name
        if _bits(src) != _bits(dst):
            raise ValueError(f"BitCast from {src} to {dst}: the widths differ")
        if src == dst:
            return x
        if "bool" in (src, dst):
            return relax.op.astype(x, dst)
        return bb.emit_te(lambda t: te.compute(t.shape, lambda *i: tirx.reinterpret(dst, t(*i)),
                                               name="bitcast"), x, primfunc_name_hint="bitcast")
