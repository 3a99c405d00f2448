"""Helpers shared by the canonicalisation passes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

from ...relax_shapes import static_shape
from .._util import rewrite_functions

HALF = ("float16", "bfloat16")


def dtype_of(expr: relax.Expr) -> str:
    """The element dtype of a tensor expression ("" when unknown)."""
    ty = expr.ty
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else ""


def ndim_of(expr: relax.Expr) -> int:
    """The rank of a tensor expression (-1 when unknown)."""
    ty = expr.ty
    return int(ty.ndim) if isinstance(ty, relax.TensorType) else -1


def is_gemm(call: relax.Expr) -> bool:
    """``matmul(a, b)`` with a right operand of rank 2 (a Linear / projection: ``(..., K) · (K, N)``).

    Batched products (both operands ≥ 3-D: attention's QKᵀ and P·V) are not GEMMs here.
    """
    return (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
            and call.op.name == "relax.matmul" and ndim_of(call.args[1]) == 2
            and ndim_of(call.args[0]) >= 2)


Rewrite = Callable[[tvm.IRModule, relax.Function], relax.Function]


def rewrite_relax_functions(mod: tvm.IRModule, rewrite: Rewrite) -> tvm.IRModule:
    """A copy of ``mod`` with ``rewrite(mod, f)`` applied to each Relax function (unused bindings
    dropped); ``mod`` is untouched (:func:`~tvmfuse.passes._util.rewrite_functions` copies)."""
    return rewrite_functions(mod, lambda func: relax.analysis.remove_all_unused(rewrite(mod, func)))


def gather_rows(x: relax.Expr, flat: np.ndarray, m: int) -> relax.Expr:
    """``x`` (static shape) read at row-major offsets ``flat`` (any shape G) into its first ``m`` axes:
    a (G + x.shape[m:]) tensor, as the cheapest op that computes it.

    * a view, ``reshape(x, G + rest)``, when ``flat`` is 0, 1, …, P - 1 in order (P the rows);
    * a broadcast of that view when ``flat`` only repeats such a grid along some axes of G (an
      index grid broadcast over heads or queries);
    * else ``take`` of the rows of ``reshape(x, (P,) + rest)`` at the constant ``flat``.
    """
    shape = static_shape(x)
    rows, rest = int(np.prod(shape[:m])), tuple(shape[m:])
    core = flat
    for axis in range(flat.ndim):  # drop the axes along which the offsets repeat
        if core.shape[axis] > 1 and (core == core.take([0], axis=axis)).all():
            core = core.take([0], axis=axis)
    if core.size == rows and (core.reshape(-1) == np.arange(rows)).all():
        view = relax.op.reshape(x, core.shape + rest)
        if core.shape == flat.shape:
            return view
        return relax.op.broadcast_to(view, flat.shape + rest)
    table = relax.op.reshape(x, (rows, *rest)) if m != 1 else x
    return relax.op.take(table, relax.const(flat.astype("int64"), "int64"), axis=0)
