"""ONNX ``ReverseSequence`` (opset 10), ``sequence_lens`` a runtime (B,) tensor::

    Y[b, t] = X[b, len[b] − 1 − t]   if t < len[b]       (b along batch_axis, t along time_axis)
            = X[b, t]                 otherwise

one ``gather_elements`` along ``time_axis`` with the index computed at run time.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import shape_expr, static_shape
from ._common import refuse


class ReverseSequence(stock.OnnxOpConverter):
    """``ReverseSequence`` as a gather of reversed time indices."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x, lens = inputs
        shape = static_shape(x)
        if shape is None:
            raise refuse(attr, "ReverseSequence", "input with a dynamic shape")
        batch_axis, time_axis = attr.get("batch_axis", 1), attr.get("time_axis", 0)
        steps = shape[time_axis]
        view = [1] * len(shape)
        view[time_axis] = steps
        t = relax.op.reshape(relax.op.arange(0, steps, 1, "int64"), shape_expr(view))
        view = [1] * len(shape)
        view[batch_axis] = shape[batch_axis]
        n = bb.normalize(relax.op.reshape(relax.op.astype(lens, "int64"), shape_expr(view)))
        rev = relax.op.subtract(relax.op.subtract(n, relax.const(1, "int64")), t)
        index = relax.op.where(relax.op.less(t, n), rev, t)
        index = bb.normalize(relax.op.broadcast_to(index, shape_expr(shape)))
        return relax.op.gather_elements(x, index, axis=time_axis)
