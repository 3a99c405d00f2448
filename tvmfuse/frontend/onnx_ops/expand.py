"""ONNX ``Expand`` with a runtime ``shape`` tensor: the output is the broadcast of both shapes.

TVM 0.27 broadcasts the data to the runtime ``shape`` itself, which is wrong when a ``shape``
entry is 1 and the data's dim is not (``test_expand_dim_changed``: data (3, 1), shape (2, 1, 6)
gives (2, 3, 6), not (2, 1, 6)). Here, with the data right-aligned to the shape's length ``r``::

    out[i] = max(shape[i], data_dim[i])      (shape[i] ∈ {1, data_dim[i]} or data_dim[i] = 1)

A ``shape`` longer than the data pads the data with leading 1s; a shorter one is refused
(ONNX broadcasts it, but the output rank would then be the data's and the runtime dims unused).
Constant and ``Shape``-derived shapes keep 0.27's (static) path.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock


class Expand(stock.Expand):
    """``Expand`` whose runtime target shape is broadcast with the data's shape."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, shape = inputs[0], inputs[1]
        if isinstance(shape, relax.ShapeExpr | tvm.ir.GenericConst):
            return super()._impl_v13(bb, inputs, attr, params)
        rank = int(shape.ty.shape.values[0])
        data_shape = list(data.ty.shape)
        if rank < len(data_shape):
            raise ValueError(f"Expand: a runtime shape of length {rank} shorter than the data's "
                             f"rank {len(data_shape)} is not supported")
        as_shape = bb.emit(relax.Call(relax.ExternFunc("vm.builtin.tensor_to_shape"), [shape],
                                      ty_args=[relax.ShapeType(ndim=rank)]))
        dims = [tirx.Var(f"expand_{i}", "int64") for i in range(rank)]
        bb.match_cast(as_shape, relax.ShapeType(dims))
        padded = [tirx.IntImm("int64", 1)] * (rank - len(data_shape)) + data_shape
        if len(padded) != len(data_shape):
            data = bb.normalize(relax.op.reshape(data, relax.ShapeExpr(padded)))
        out = [tirx.max(d, p) for d, p in zip(dims, padded)]
        return bb.normalize(relax.op.broadcast_to(data, relax.ShapeExpr(out)))
