"""Norm epilogues read the GEMM's fp32 accumulator, not a half-precision copy of it.

ToMixedPrecision stores every matmul result in half precision, so the fp32 norm epilogue that
NormGemmPrologue wrote (``rstd ⊙ acc``, ``acc − μ ⊗ colsum``) gets a rounded copy widened again:

    acc = matmul(x16, W16, out_dtype="float32")            (M, N) fp32
    w   = astype(astype(acc, "float16"), "float32")         rounded to 11 bits, then widened
    y   = multiply(w, rstd)                                 rstd (M, 1) fp32, one value per row

→ ``y = multiply(acc, rstd)``. That is the fp32 graph's math (more accurate, not less), and it keeps
the epilogue in the GEMM's kernel. Both the GEMM and the statistics kernel are out-elementwise
fusable, and FuseOps gives the ``multiply`` to the first of them, in binding order, whose chain
reaches it: the statistics are bound between the two casts, so they took it (dlight's Reduction
rule then scheduled that kernel instead of RowStats) and the GEMM wrote its result to HBM in fp32.

Matched consumers of the widened value (the two ways NormGemmPrologue's epilogue starts):

* ``multiply(w, s)`` / ``multiply(s, w)``, ``s`` a computed fp32 per-row tensor (…, 1) — rstd;
* ``subtract(w, multiply(m, c))`` (either operand order in the ``multiply``), ``m`` a computed fp32
  per-row tensor and ``c`` a constant fp32 row of N values — LayerNorm's ``μ ⊗ colsum(W')``.

Every other cast pair is left as it is (removing one changes the numerics the graph asked for).
Sits right after ``ToMixedPrecision`` (inside :class:`~.mixed_precision.MixedPrecision`), before
anything fuses or legalises; the casts it orphans are removed.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._util import bound_value, is_op, static_shape

_HALF = ("float16", "bfloat16")
_F32 = "float32"


def _dtype(expr: relax.Expr) -> str | None:
    ty = expr.ty
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def _per_row(s: relax.Expr, like: relax.Expr) -> bool:
    """``s`` is a computed fp32 tensor with one value per row of ``like``: shape (…, 1)."""
    shape, full = static_shape(s), static_shape(like)
    return (isinstance(s, relax.Var) and _dtype(s) == _F32 and shape is not None
            and full is not None and shape == [*full[:-1], 1])


@mutator
class _Rewrite(PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.rewritten = 0

    def _bound(self, expr: relax.Expr) -> relax.Expr:
        return bound_value(self, expr)

    def _accumulator(self, w: relax.Expr) -> relax.Var | None:
        """``acc`` when ``w`` is ``astype(astype(acc, half), float32)`` and ``acc`` an fp32 matmul."""
        widen = self._bound(w)
        if not (is_op(widen, "relax.astype") and str(widen.attrs.dtype) == _F32):
            return None
        narrow = self._bound(widen.args[0])
        if not (is_op(narrow, "relax.astype") and str(narrow.attrs.dtype) in _HALF):
            return None
        acc = narrow.args[0]
        if not (isinstance(acc, relax.Var) and is_op(self._bound(acc), "relax.matmul")
                and _dtype(acc) == _F32):
            return None
        return acc

    def _centering(self, p: relax.Expr, like: relax.Expr) -> bool:
        """``p`` is ``multiply(m, c)`` with ``m`` per-row fp32 and ``c`` a constant fp32 row."""
        call = self._bound(p)
        if not is_op(call, "relax.multiply"):
            return False
        for m, c in (call.args, call.args[::-1]):
            full = static_shape(like)
            if (_per_row(m, like) and isinstance(c, tvm.ir.expr.Constant) and _dtype(c) == _F32
                    and full is not None and static_shape(c) == [full[-1]]):
                return True
        return False

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        args = list(call.args)
        if is_op(call, "relax.multiply"):
            for i in (0, 1):
                acc = self._accumulator(args[i])
                if acc is not None and _per_row(args[1 - i], acc):
                    args[i] = acc
                    break
        elif is_op(call, "relax.subtract"):
            acc = self._accumulator(args[0])
            if acc is not None and self._centering(args[1], acc):
                args[0] = acc
        if all(a.same_as(b) for a, b in zip(args, call.args, strict=True)):
            return call
        self.rewritten += 1
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.NormEpilogueFp32")
class NormEpilogueFp32:
    """``op(astype(astype(acc, half), f32), stats)`` → ``op(acc, stats)`` for norm epilogues."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewrite(mod)
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        if not rewriter.rewritten:
            return mod
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
