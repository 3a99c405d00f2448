"""ONNX ``ConstantOfShape`` whose shape is a runtime tensor::

    Y = full(shape, value)          shape (n,) int64, value a 1-element tensor (default 0.0f)

0.27 broadcasts to ``tensor_to_shape(shape)`` as a bare shape variable, which LegalizeOps leaves
unlowered (VM codegen then fails); here the shape is matched to ``n`` symbolic dims first (a
negative dim fails the call: :func:`~.runtime_values.symbolic_dims`).
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._common import constant
from .runtime_values import all_of, int64, symbolic_dims


class ConstantOfShape(stock.ConstantOfShape):
    """``ConstantOfShape`` with a runtime shape as ``R.full`` of symbolic dims."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        shape = inputs[0]
        if constant(shape, params) is not None or isinstance(shape, relax.ShapeExpr) \
                or not isinstance(shape.ty, relax.TensorType):
            return super()._impl_v9(bb, inputs, attr, params)
        value = attr.get("value")
        array = stock.get_numpy(value).reshape(()) if value is not None else None
        fill = relax.const(0.0, "float32") if array is None else relax.const(array, array.dtype.name)
        shape = bb.normalize(relax.op.astype(shape, "int64"))
        ok = bb.normalize(all_of(relax.op.greater_equal(shape, int64(0))))
        dims = symbolic_dims(bb, shape, int(shape.ty.shape.values[0]), "constant_of_shape_d", ok)
        return relax.op.full(relax.ShapeExpr(dims), fill, str(fill.ty.dtype))
