"""TIR expression helpers shared by the kernel generators and the schedule rules.

0.27 spells a buffer load ``tvm.ir.TensorLoad(source, indices)`` and keeps a primitive expression's
dtype in ``e.ty``; these names hide that from the readers of fused PrimFuncs.
"""

from __future__ import annotations

import tvm
from tvm import DataType, tirx

Load = tvm.ir.TensorLoad  # 0.27: buffer loads are TensorLoad(source, indices)
Call = tvm.ir.Call
Op = tvm.ir.Op
# binary PrimExpr nodes an epilogue may contain (arithmetic, comparisons, logic)
BINARY_OPS = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Min, tirx.Max, tirx.FloorDiv,
              tirx.FloorMod, tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.And, tirx.Or)
# math intrinsics an epilogue may use; TVMScript spells tirx.X as T.X
MATH_CALLS = {f"tirx.{n}" for n in ("exp", "exp2", "log", "erf", "tanh", "sigmoid", "sqrt", "rsqrt",
                                    "pow", "fabs", "floor", "ceil", "round", "isnan", "isinf")}


def dtype_of(e: tirx.PrimExpr) -> str:
    """dtype of a primitive expression (0.27 keeps it in ``e.ty``)."""
    return str(e.ty.dtype)


def strip_cast(e: tirx.PrimExpr) -> tirx.PrimExpr:
    """``x`` for ``Cast(t, x)``, else ``e``."""
    return e.value if isinstance(e, tirx.Cast) else e


def const_int(e) -> int | None:
    """The value of a constant integer (Python int or IntImm), None for anything symbolic."""
    if isinstance(e, int):
        return e
    if isinstance(e, tirx.IntImm):
        return int(e.value)
    return None


def dtype_bytes(buffer: tirx.Buffer) -> int:
    """Bytes per element of ``buffer`` (at least 1: bool and sub-byte types count as one)."""
    return max(1, DataType(str(buffer.dtype)).bits // 8)


class UnknownExpr(Exception):
    """An expression kind :func:`rebuild` does not know (the caller's rewrite does not apply)."""


def rebuild(expr: tirx.PrimExpr, post, pre=None) -> tirx.PrimExpr:
    """``expr`` rebuilt bottom-up, each node passed through ``post(node)`` after its children
    (TVM 0.27 exposes no TIR expression mutator to Python). Vars, constants, arithmetic and
    comparisons, ``Not``, casts, ``Select``, buffer loads and intrinsic calls are rebuilt; any
    other node raises :class:`UnknownExpr`. ``pre(node)``, where given, is asked first: a
    PrimExpr it returns replaces the node and its children are not visited (None: go on)."""

    def visit(e):
        if pre is not None and (new := pre(e)) is not None:
            return new
        if isinstance(e, (tirx.Var, tirx.IntImm, tirx.FloatImm)):
            new = e
        elif isinstance(e, (*BINARY_OPS, tirx.Mod)):
            new = type(e)(visit(e.a), visit(e.b))
        elif isinstance(e, tirx.Not):
            new = tirx.Not(visit(e.a))
        elif isinstance(e, tirx.Cast):
            new = tirx.Cast(dtype_of(e), visit(e.value))
        elif isinstance(e, tirx.Select):
            new = tirx.Select(visit(e.condition), visit(e.true_value), visit(e.false_value))
        elif isinstance(e, Load):
            new = tirx.BufferLoad(e.source, [visit(i) for i in e.indices])
        elif isinstance(e, Call) and isinstance(e.op, Op):
            new = tirx.call_intrin(dtype_of(e), e.op, *[visit(a) for a in e.args])
        else:
            raise UnknownExpr(type(e).__name__)
        return post(new)

    return visit(expr)


def substitute(expr: tirx.PrimExpr, vmap: list[tuple[tirx.Var, tirx.PrimExpr]]) -> tirx.PrimExpr:
    """``expr`` with each var of ``vmap`` replaced."""
    def post(e):
        if isinstance(e, tirx.Var):
            return next((new for old, new in vmap if old.same_as(e)), e)
        return e

    return rebuild(expr, post)

