"""ONNX ``ConstantOfShape`` whose shape is a runtime tensor::

    Y = full(shape, value)          shape (n,) int64, value a 1-element tensor (default 0.0f)

0.27 broadcasts to ``tensor_to_shape(shape)`` as a bare shape variable, which LegalizeOps leaves
unlowered (VM codegen then fails); here the shape is matched to ``n`` symbolic dims first.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._common import constant, runtime_shape


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
        dims = runtime_shape(bb, shape, int(shape.ty.shape.values[0]), "constant_of_shape_d")
        return relax.op.full(dims, fill, str(fill.ty.dtype))
