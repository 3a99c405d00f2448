"""Helpers shared by the canonicalisation passes."""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

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
