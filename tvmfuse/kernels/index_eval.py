"""Integer index expressions of a PrimFunc evaluated in numpy over all points of a block.

A rule that moves an injective kernel's stores into another kernel (the decode append into the
QKV GEMV, a GEMM's gather tail into its epilogue) must know, for every output point, which
elements of the other kernel's output it reads. :func:`value` evaluates an index expression over
arrays of the block's iteration variables; :func:`reads` lists every load of one buffer with its
indices at each point and the points where it is evaluated (a select whose condition is an index
expression splits them).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import tirx

from .tir_util import BINARY_OPS, Call, Load, dtype_of


class Unknown(Exception):
    """The expression's value depends on data (a buffer load) or is not an integer."""


_NP = {tirx.Add: np.add, tirx.Sub: np.subtract, tirx.Mul: np.multiply, tirx.Min: np.minimum,
       tirx.Max: np.maximum, tirx.FloorDiv: np.floor_divide, tirx.FloorMod: np.mod,
       tirx.EQ: np.equal, tirx.NE: np.not_equal, tirx.LT: np.less, tirx.LE: np.less_equal,
       tirx.GT: np.greater, tirx.GE: np.greater_equal, tirx.And: np.logical_and,
       tirx.Or: np.logical_or}


def is_select(e) -> bool:
    return isinstance(e, tirx.Select) or (isinstance(e, Call) and isinstance(e.op, tvm.ir.Op)
                                          and e.op.name == "prim.if_then_else")


def select_parts(e) -> tuple:
    return (e.condition, e.true_value, e.false_value) if isinstance(e, tirx.Select) else tuple(e.args)


def value(e, env: list) -> np.ndarray:
    """``e`` (an integer / boolean index expression) over the points of ``env`` ((var, array)
    pairs, broadcasting); raises :class:`Unknown` where it reads data or is not an integer."""
    if isinstance(e, tirx.Var):
        found = next((a for v, a in env if v.same_as(e)), None)
        if found is None:
            raise Unknown(e.name)
        return found
    if isinstance(e, tirx.IntImm):
        return np.int64(e.value)
    if type(e) in _NP:
        return _NP[type(e)](value(e.a, env), value(e.b, env))
    if isinstance(e, (tirx.Div, tirx.Mod)):  # truncated: the sign of the dividend
        a, b = value(e.a, env), value(e.b, env)
        q = np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))
        return q if isinstance(e, tirx.Div) else a - b * q
    if isinstance(e, tirx.Not):
        return np.logical_not(value(e.a, env))
    if isinstance(e, tirx.Cast) and (dtype_of(e).startswith(("int", "uint")) or dtype_of(e) == "bool"):
        v = value(e.value, env)
        return v.astype(bool) if dtype_of(e) == "bool" else np.asarray(v).astype(np.int64)
    if is_select(e):
        c, a, b = select_parts(e)
        return np.where(value(c, env), value(a, env), value(b, env))
    raise Unknown(type(e).__name__)


def children(e) -> list:
    if isinstance(e, (*BINARY_OPS, tirx.Mod)):
        return [e.a, e.b]
    if isinstance(e, tirx.Not):
        return [e.a]
    if isinstance(e, tirx.Cast):
        return [e.value]
    if isinstance(e, Load):
        return list(e.indices)
    if isinstance(e, Call):
        return list(e.args)
    return []


def reads(e, buf: tirx.Buffer, env: list, mask: np.ndarray, found: list) -> None:
    """Append ``(indices, mask, load)`` for every load of ``buf`` in ``e``: its indices evaluated at the
    points, ``mask`` the points where the load is evaluated (the branches of a select whose
    condition is known split it). Raises :class:`Unknown` for an index that depends on data."""
    if isinstance(e, Load) and e.source.same_as(buf):
        found.append(([value(i, env) for i in e.indices], mask, e))
    if is_select(e):
        c, a, b = select_parts(e)
        reads(c, buf, env, mask, found)
        try:
            taken = np.broadcast_to(value(c, env), mask.shape)
        except Unknown:  # a data-dependent branch: either may be evaluated
            taken = None
        reads(a, buf, env, mask if taken is None else mask & taken, found)
        reads(b, buf, env, mask if taken is None else mask & ~taken, found)
        return
    for child in children(e):
        reads(child, buf, env, mask, found)
