"""Static shapes of Relax tensors, shared by the frontend fixes and the graph passes (base layer)."""

from __future__ import annotations

import tvm
from tvm import relax


def static_shape(expr: relax.Expr) -> list[int] | None:
    """Static shape of a tensor expression, else None (also when the shape is a shape variable,
    as ``R.broadcast_to(c, shape_var)`` of a runtime ``ConstantOfShape`` gives)."""
    return static_type_shape(expr.ty)


def static_type_shape(ty) -> list[int] | None:
    """:func:`static_shape` of a type (a tuple's field, say)."""
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    try:
        return [int(d) for d in ty.shape.values]
    except TypeError:  # symbolic dimension
        return None


def shape_expr(dims: list[int]) -> relax.ShapeExpr:
    """A static ShapeExpr with int64 dims, as importers and TVMScript write them."""
    return relax.ShapeExpr([tvm.tirx.IntImm("int64", d) for d in dims])
