"""A half-precision norm computed in fp32 → one kernel that reads and writes half precision.

    y = astype(rms_norm(astype(x, f32), γ), half)               x (…, K) half, γ (K,) fp32
    y = astype(layer_norm(astype(x, f32), γ, β), half)          β (K,) fp32

FuseDecomposedNorms writes the fp16/bf16 RMSNorms whose weight multiplies in fp32 this way (Gemma's
``1 + w``, F.rms_norm, nn.RMSNorm); ONNX RMSNormalization imports this way. Where NormGemmPrologue
cannot fold it into a GEMM (the normed tensor has other users, e.g. a residual), TVM's FuseOps keeps
the input cast as a kernel of its own: the legalised norm is a reduction with an epilogue, and such a
group takes no elementwise producer. Rewritten to one PrimFunc (the casts inside it, topi's fp32
norm between them) it is one kernel: x read once in half precision, y written once, statistics and
parameters in fp32 — the math of the three ops it replaces.

Only a norm whose fp32 result is used by the cast alone is rewritten (else it would run twice).
Runs at the end of NormGemmPrologue (on the norms it left), before LegalizeOps.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._util import bound_value, dataflow_bindings, is_op

_HALF = ("float16", "bfloat16")
_NORMS = ("relax.nn.rms_norm", "relax.nn.layer_norm")


def _fp32_norm(x: te.Tensor, *params, name: str, axes, eps: float) -> te.Tensor:
    """``cast(norm(cast(x, f32), *params), x.dtype)`` with topi's norm; params are fp32."""
    norm = topi.nn.rms_norm if name == "rms_norm" else topi.nn.layer_norm
    return topi.cast(norm(topi.cast(x, "float32"), *params, axis=axes, epsilon=eps), x.dtype)


def _use_counts(func: relax.Function) -> dict:
    """var → number of bindings (and the function's result) that use it."""
    counts: dict = {}
    bound, _ = dataflow_bindings(func)
    for expr in [*bound.values(), func.body.body]:
        for var in relax.analysis.free_vars(expr):
            counts[var] = counts.get(var, 0) + 1
    return counts


@mutator
class _Rewrite(PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.uses: dict = {}
        self.rewritten = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (is_op(call, "relax.astype") and str(call.attrs.dtype) in _HALF):
            return call
        norm = bound_value(self, call.args[0])
        if not (isinstance(norm, relax.Call) and isinstance(norm.op, tvm.ir.Op) and norm.op.name in _NORMS
                and self.uses.get(call.args[0], 0) == 1):
            return call
        if norm.op.name == "relax.nn.layer_norm" and not (norm.attrs.center and norm.attrs.scale):
            return call
        up = bound_value(self, norm.args[0])
        if not (is_op(up, "relax.astype") and str(up.attrs.dtype) == "float32"
                and str(up.args[0].ty.dtype) == str(call.attrs.dtype)):
            return call
        name = norm.op.name.rsplit(".", 1)[1]
        self.rewritten += 1
        return self.builder_.call_te(_fp32_norm, up.args[0], *norm.args[1:], name=name,
                                     axes=[int(a) for a in norm.attrs.axes],
                                     eps=float(norm.attrs.epsilon), primfunc_name_hint=name)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.HalfNormOneKernel")
class HalfNormOneKernel:
    """``astype(norm(astype(x, f32), params32), half)`` → one PrimFunc: half in, fp32 math, half out."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewrite(mod)
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                rewriter.uses = _use_counts(func)
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        if not rewriter.rewritten:
            return mod
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
