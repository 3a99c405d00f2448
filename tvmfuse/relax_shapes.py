"""Static shapes of Relax tensors, shared by the frontend fixes and the graph passes (base layer)."""

from __future__ import annotations

import tvm
import tvm.sym
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


def symbol_ranges(mod: tvm.IRModule) -> dict[str, tuple[int, int]]:
    """Each symbolic dimension's inclusive range, by name, from the Relax functions'
    ``tir_var_lower_bound`` / ``tir_var_upper_bound`` (set at import from ``--dynamic``)."""
    ranges: dict[str, tuple[int, int]] = {}
    for _, func in mod.functions_items():
        attrs = func.attrs if isinstance(func, relax.Function) and func.attrs is not None else {}
        upper = dict(attrs.get("tir_var_upper_bound", {}))
        lower = dict(attrs.get("tir_var_lower_bound", {}))
        for name, hi in upper.items():
            ranges[str(name)] = (int(lower.get(name, 1)), int(hi))
    return ranges


def upper_bound(expr: tvm.tirx.PrimExpr, ranges: dict[str, tuple[int, int]]) -> int | None:
    """The largest value of an integer expression of symbols in ``ranges`` (None: unbounded)."""
    analyzer = tvm.sym.Analyzer()
    for var in tvm.tirx.analysis.undefined_vars(expr):
        if var.name not in ranges:
            return None
        lo, hi = ranges[var.name]
        analyzer.bind(var, tvm.ir.Range.from_min_extent(lo, hi - lo + 1))
    bound = analyzer.const_int_bound(expr).max_value
    return None if bound >= 2**62 else int(bound)
