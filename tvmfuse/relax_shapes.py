"""Static shapes of Relax tensors, shared by the frontend fixes and the graph passes (base layer)."""

from __future__ import annotations

import tvm
import tvm.sym
import tvm_ffi
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


def shape_expr(dims: list) -> relax.ShapeExpr:
    """A ShapeExpr with int64 dims, as importers and TVMScript write them (ints, or the PrimExprs
    of a :func:`known_shape`)."""
    return relax.ShapeExpr([tvm.tirx.IntImm("int64", d) if isinstance(d, int) else d for d in dims])


def same_dim(a, b) -> bool:
    """Two extents are equal: ints (or IntImms) by value, symbolic ones structurally."""
    a, b = (int(x) if isinstance(x, tvm.tirx.IntImm) else x for x in (a, b))
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    return bool(tvm_ffi.structural_equal(a, b))


def same_shape(a: list | None, b: list | None) -> bool:
    """Two :func:`known_shape` results are the same known shape."""
    return a is not None and b is not None and len(a) == len(b) and all(
        same_dim(x, y) for x, y in zip(a, b))


LOWER_BOUND = "tir_var_lower_bound"  # Relax function attrs: symbol name → inclusive bound
UPPER_BOUND = "tir_var_upper_bound"


def symbol_ranges(mod: tvm.IRModule) -> dict[str, tuple[int, int]]:
    """Each symbolic dimension's inclusive range, by name, from the Relax functions'
    ``tir_var_lower_bound`` / ``tir_var_upper_bound`` (set at import from ``--dynamic``)."""
    ranges: dict[str, tuple[int, int]] = {}
    for _, func in mod.functions_items():
        attrs = func.attrs if isinstance(func, relax.Function) and func.attrs is not None else {}
        upper = dict(attrs.get(UPPER_BOUND, {}))
        lower = dict(attrs.get(LOWER_BOUND, {}))
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


def known_shape(expr: relax.Expr) -> list | None:
    """The shape of a tensor expression with symbolic dims kept: ints where static, PrimExprs
    where symbolic (``(1, S, 64)`` → ``[1, S, 64]``); None when only the rank (or less) is known."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return [int(d) if isinstance(d, tvm.tirx.IntImm) else d for d in ty.shape.values]

