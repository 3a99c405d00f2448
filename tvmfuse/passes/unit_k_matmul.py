"""A product over a contraction of length 1 is a broadcast multiply, not a GEMM.

    matmul(a (..., M, 1), b (..., 1, N), out_dtype=d)  →  multiply(astype(a, d), astype(b, d))

(the casts only where the operand's dtype is not ``d``; NumPy broadcasting of the leading axes is
the same for both). Outer products like this come from recurrences written as matmuls (ONNX
``LinearAttention``'s state update ``S + kᵀ·v``, an unrolled scan). As a reduction over one
element they met a TVM defect on the GPU: the schedule rules inline the ``+ S`` consumer into the
reduction block, which puts it in the block's init *and* its update, and every state came out
``2·S + kᵀ·v`` (H200: 28 wrong ONNX node tests). As a multiply there is no reduction to get wrong,
and it fuses with its neighbours like any elementwise op.

Pipeline stage ``unit_k_matmul``, after the pattern passes: attention without a cache at one key
(compile_lm's decode before the cache is derived) has a P·V product with K = 1 that FuseAttention
must still see as a matmul.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._util import is_op
from .canonical._common import dtype_of, ndim_of, rewrite_relax_functions


def _contraction_is_one(a: relax.Expr) -> bool:
    """``a``'s last dim is the static length 1."""
    ty = a.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return False
    dims = list(getattr(ty.shape, "values", []) or [])
    return bool(dims) and isinstance(dims[-1], tvm.tirx.IntImm) and int(dims[-1]) == 1


@mutator
class _UnitK(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.matmul"):
            return call
        a, b = call.args
        if ndim_of(a) < 2 or ndim_of(b) < 2 or not _contraction_is_one(a):
            return call
        out = str(call.attrs.out_dtype) if call.attrs.out_dtype is not None else ""
        out = out if out not in ("", "void") else dtype_of(a)
        a, b = (x if dtype_of(x) == out else relax.op.astype(x, out) for x in (a, b))
        return relax.op.multiply(a, b)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.UnitKMatmul")
class UnitKMatmul:
    """Module pass: every matmul with a static contraction length 1 → a broadcast multiply."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_relax_functions(
            mod, lambda m, f: _UnitK(m).visit_expr(f))
