"""Explicit ``.float()`` upcasts around a GEMM become the fp32-accumulating half GEMM they mean.

    matmul(V(astype(a, f32)), V'(astype(b, f32)), out_dtype=f32)  →  matmul(V(a), V'(b), out_dtype=f32)

``a``, ``b`` of one half dtype (float16 or bfloat16); ``V``, ``V'`` chains of views (reshape,
permute_dims) that are re-applied to the half tensors. A float32 constant whose every value is
exact in that half dtype counts as an upcast too (exporters fold ``w.float()`` of a half weight
into an fp32 initializer). The products of half values are exact in fp32, so both sides compute
the same sums; the rewritten GEMM reads half the bytes and takes the tensor-core GEMM rules
(which need half operands and an fp32 accumulator). A cast back (``.to(x.dtype)``) stays as it is:
it becomes the GEMM's epilogue.

Only GEMMs (2-D right operand, see ``_common.is_gemm``); attention's batched products are peeled by
FuseAttention itself. Runs after HalfMatmulAccumulate (every GEMM then names ``out_dtype``).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._util import const_array, is_op
from ._common import HALF, dtype_of, is_gemm, rewrite_relax_functions

_VIEWS = ("relax.reshape", "relax.permute_dims")


def _to_half(arr: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes

    with np.errstate(over="ignore"):
        return arr.astype(np.float16 if dtype == "float16" else ml_dtypes.bfloat16)


def _exact_in(arr: np.ndarray, dtype: str) -> bool:
    """True when every value of the fp32 array ``arr`` is representable in ``dtype``."""
    return bool(np.array_equal(_to_half(arr, dtype).astype(np.float32), arr, equal_nan=True))


@mutator
class _Upcast(PyExprMutator):
    def _peel(self, expr: relax.Expr) -> tuple[relax.Expr, list[relax.Call], str | None]:
        """``(source, views outermost first, half dtype)`` of an upcast operand; dtype None when
        the operand is an fp32 constant (its half dtype is the other operand's)."""
        views = []
        while True:
            value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr
            if value is None:
                return expr, views, ""
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in _VIEWS:
                views.append(value)
                expr = value.args[0]
            elif is_op(value, "relax.astype") and dtype_of(value.args[0]) in HALF:
                return value.args[0], views, dtype_of(value.args[0])
            elif const_array(value) is not None:
                return value, views, None
            else:
                return expr, views, ""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_gemm(call) or str(call.attrs.out_dtype) != "float32" or dtype_of(call.args[0]) != "float32":
            return call
        (sa, va, da), (sb, vb, db) = (self._peel(arg) for arg in call.args)
        dtypes = {d for d in (da, db) if d is not None}
        if "" in dtypes or len(dtypes) != 1:
            return call  # an operand that is no upcast, mixed half dtypes, or two constants
        (dtype,) = dtypes
        operands = []
        for src, views, d in ((sa, va, da), (sb, vb, db)):
            if d is None:  # fp32 constant: exact in the half dtype, else no rewrite
                arr = const_array(src)
                if not _exact_in(arr, dtype):
                    return call
                src = relax.const(tvm.runtime.tensor(_to_half(arr, dtype)), dtype)
            operands.append(self._rebuild_views(src, views))
        return relax.op.matmul(*operands, out_dtype="float32")

    def _rebuild_views(self, src: relax.Expr, views: list[relax.Call]) -> relax.Expr:
        for view in reversed(views):
            src = self.builder_.emit(relax.Call(view.op, [src, *view.args[1:]], view.attrs))
        return src


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.UpcastMatmul")
class UpcastMatmul:
    """``astype(a16, f32) @ astype(b16, f32)`` → ``matmul(a16, b16, out_dtype=f32)`` (GEMMs only)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_relax_functions(mod, lambda m, f: _Upcast(m).visit_expr(f))
