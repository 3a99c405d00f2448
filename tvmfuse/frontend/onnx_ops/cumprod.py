"""ONNX ``CumProd`` (opset 26), which TVM 0.27 has no converter for::

    y[…, i, …] = Π_{j ≤ i} x[…, j, …]     (exclusive: j < i, the first is 1;
                                            reverse: j ≥ i / j > i)

along ``axis`` (a constant here; a runtime axis goes through :mod:`.runtime_axis`'s candidates,
one scan per axis). ``reverse`` flips the input along ``axis`` before the scan and the result after.
"""

from __future__ import annotations

from tvm import relax, topi
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._common import constant


class CumProd(stock.OnnxOpConverter):
    """``CumProd(x, axis)`` with a constant ``axis`` (``exclusive``, ``reverse``)."""

    @classmethod
    def _impl_v26(cls, bb, inputs, attr, params):
        data = inputs[0]
        value = constant(inputs[1], params)
        if value is None or value.size != 1:
            raise ValueError(f"CumProd: axis must be a constant scalar here, got {inputs[1]}")
        axis = int(value.reshape(-1)[0])
        rank = data.ty.ndim
        if not -rank <= axis < rank:
            raise ValueError(f"CumProd: axis {axis} out of range for rank {rank}")
        axis %= rank
        reverse = attr.get("reverse", 0) != 0
        if reverse:
            data = bb.emit_te(topi.flip, data, axis=axis)
        out = bb.normalize(relax.op.cumprod(data, axis, exclusive=attr.get("exclusive", 0) != 0))
        return bb.emit_te(topi.flip, out, axis=axis) if reverse else out

