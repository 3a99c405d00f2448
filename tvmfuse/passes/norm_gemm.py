"""Norm + following Linear(s) → row statistics + one GEMM whose epilogue applies them.

    rms_norm(x, g) · W       = rstd ⊙ (x · W')                        W' = diag(g) · W
    layer_norm(x, γ, β) · W  = rstd ⊙ (x · W' − μ ⊗ colsum(W')) + β · W   W' = diag(γ) · W

with μ, rstd per row of x (one small reduction kernel that writes 1–2 numbers per row). The
normalised tensor is never written to HBM: the GEMM reads x itself and the statistics are applied
to its accumulators, in fp32. Q/K/V projections of one normed input share the statistics.
Only constant weights are folded (W' and colsum are computed at compile time); anything else is
left alone. On CUDA the statistics kernel is scheduled by ``schedules/row_stats.py`` (x read once
into registers, both reductions from there); on sm_90a, where the GEMM is the wgmma kernel,
``schedules/gemm_sm90_stats.py`` removes it and the GEMM computes the statistics in its main loop.
A half-precision norm computed in fp32, ``astype(norm(astype(x, f32), γ32), half)`` (FuseDecomposedNorms
makes it from Gemma's / nn.RMSNorm's spelling; ONNX RMSNormalization imports as it), folds the same
way with x the half tensor: W' = diag(γ32) · W is rounded once to W's dtype.
Half-precision norms computed in fp32 that stay (the normed tensor has other users) are then made one
kernel each by :class:`~.norm_half_io.HalfNormOneKernel`.
Sits after FuseDecomposedNorms (which makes the norm ops this pass looks for) and before LegalizeOps.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, s_tir, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.tirx.buffer import BufferType

from ..errors import TVM_ERRORS
from . import weight_arrays
from ._util import bound_value, constant_weight, folded_constant, known_shape
from ._util import is_op as _is_op
from .norm_half_io import HalfNormOneKernel

_NORMS = ("relax.nn.rms_norm", "relax.nn.layer_norm")


def row_stats_te(x: te.Tensor, eps: float, centered: bool):
    """TE: per-row mean and rstd of the last axis (fp32), shapes (..., 1)."""
    *lead, k = x.shape
    r = te.reduce_axis((0, k), name="k")
    f32 = "float32"
    if centered:
        s1 = te.compute((*lead, 1), lambda *i: te.sum(x[(*i[:-1], r)].astype(f32), axis=r), name="s1")
        mean = te.compute((*lead, 1), lambda *i: s1[i] / tirx.const(int(k), f32), name="mean")
        r2 = te.reduce_axis((0, k), name="k2")
        s2 = te.compute((*lead, 1), lambda *i: te.sum(
            (x[(*i[:-1], r2)].astype(f32) - mean[i]) * (x[(*i[:-1], r2)].astype(f32) - mean[i]),
            axis=r2), name="s2")
    else:
        s2 = te.compute((*lead, 1), lambda *i: te.sum(
            x[(*i[:-1], r)].astype(f32) * x[(*i[:-1], r)].astype(f32), axis=r), name="s2")
        mean = None
    rstd = te.compute((*lead, 1), lambda *i: tirx.rsqrt(s2[i] / tirx.const(int(k), f32)
                                                        + tirx.const(eps, f32)), name="rstd")
    return (mean, rstd) if centered else rstd


def stats_function(x_ty: relax.TensorType, eps: float, centered: bool) -> tirx.PrimFunc:
    """The statistics PrimFunc this pass emits for an input of type ``x_ty``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", x_ty)
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit_te(row_stats_te, x, eps, centered, primfunc_name_hint="stats"))
    return bb.get()["stats"]


def row_stats_params(func: tirx.PrimFunc) -> tuple[float, bool] | None:
    """``(eps, centered)`` when ``func`` is exactly this pass's statistics PrimFunc of its first
    parameter (:func:`row_stats_te`: mean and rstd, or rstd), else None."""
    params = list(func.params)
    if len(params) not in (2, 3) or not all(isinstance(p.ty, BufferType) for p in params):
        return None
    try:  # the value of the block ``rstd``: ``rsqrt(… + eps)``, or ``rsqrt(…)`` (eps 0 folded)
        sch = s_tir.Schedule(func)
        value = sch.get(sch.get_sblock("rstd")).body.value
    except (*TVM_ERRORS, AttributeError):  # no block ``rstd``, or not a store
        return None
    if not (isinstance(value, tvm.ir.Call) and value.op.name == "tirx.rsqrt"):
        return None
    arg = value.args[0]
    eps = float(arg.b.value) if isinstance(arg, tirx.Add) and isinstance(arg.b, tirx.FloatImm) else 0.0
    centered = len(params) == 3
    x_ty = relax.TensorType(list(params[0].shape), str(params[0].dtype))
    ref = stats_function(x_ty, eps, centered)
    same = tvm_ffi.structural_equal(tirx.PrimFunc(func.params, func.body),
                                   tirx.PrimFunc(ref.params, ref.body))
    return (eps, centered) if same else None


@mutator
class _NormGemm(PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod_ = mod
        self.stats: dict = {}
        self.reshaped: dict = {}
        self.only_gemm_users: list = []
        self.rewritten = 0
        self.folds = weight_arrays.DerivedConstants()  # γ·W once per (W, γ) for all functions

    def _bound(self, expr: relax.Expr) -> relax.Expr:
        return bound_value(self, expr)

    def _norm_of(self, expr: relax.Expr):
        """(norm call, its input x, reshape shape or None) when ``expr`` is ``[reshape](norm(x))``
        or, for a half-precision norm computed in fp32, ``[reshape](astype(norm(astype(x, f32)),
        dtype(x)))``: then x is the half tensor (the statistics upcast it themselves)."""
        bound, new_shape = self._bound(expr), None
        while _is_op(bound, "relax.reshape"):  # reshape(reshape(y, s1), s2) is reshape(y, s2)
            new_shape = bound.args[1] if new_shape is None else new_shape
            bound = self._bound(bound.args[0])
        down = None
        if _is_op(bound, "relax.astype"):
            down, bound = str(bound.attrs.dtype), self._bound(bound.args[0])
        if not (isinstance(bound, relax.Call) and isinstance(bound.op, tvm.ir.Op)
                and bound.op.name in _NORMS):
            return None, None, None
        x = bound.args[0]
        if down is not None:
            up = self._bound(x)
            if not (_is_op(up, "relax.astype") and str(up.attrs.dtype) == "float32"
                    and str(up.args[0].ty.dtype) == down):
                return None, None, None  # a cast that changes the norm's result: not ours to fold
            x = up.args[0]
        return bound, x, new_shape

    def _get_stats(self, x: relax.Expr, eps: float, centered: bool):
        key = (x, eps, centered)
        if key not in self.stats:
            name = "layer_norm_stats" if centered else "rms_norm_stats"
            out = self.builder_.emit(self.builder_.call_te(row_stats_te, x, eps, centered,
                                                            primfunc_name_hint=name))
            if centered:
                out = (self.builder_.emit(relax.TupleGetItem(out, 0)),
                       self.builder_.emit(relax.TupleGetItem(out, 1)))
            self.stats[key] = out
        return self.stats[key]

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.matmul"):
            return call
        norm, x, new_shape = self._norm_of(call.args[0])
        w = constant_weight(call.args[1], self._bound)
        if norm is None or w is None or w.ndim != 2 or not any(
                norm.same_as(n) for n in self.only_gemm_users):
            return call  # a norm that is also needed elsewhere (e.g. BERT's residual) stays a kernel
        shape = known_shape(x)  # leading dims may be symbolic; the normalised one is static
        if shape is None or not isinstance(shape[-1], int):
            return call
        if shape is not None and new_shape is not None:
            last = new_shape.values[-1]
            if not isinstance(last, tvm.tirx.IntImm) or int(last) != shape[-1]:
                return call  # the reshape regroups the normalised axis
            key = (x, tuple(str(d) for d in new_shape.values))
            if key not in self.reshaped:  # Q/K/V share one view and one set of statistics
                self.reshaped[key] = self.builder_.emit(relax.op.reshape(x, new_shape))
            x = self.reshaped[key]
            shape = known_shape(x)
        axes = [int(a) for a in norm.attrs.axes]
        if shape is None or axes not in ([-1], [len(norm.args[0].ty.shape.values) - 1]) \
                or shape[-1] != w.shape[0]:
            return call
        centered = norm.op.name == "relax.nn.layer_norm"
        if centered and not (norm.attrs.center and norm.attrs.scale):
            return call
        # ONNX RMSNormalization casts its (constant) scale to fp32 in the graph: fold that too.
        gamma = folded_constant(norm.args[1], self._bound)
        beta = folded_constant(norm.args[2], self._bound) if centered else None
        if gamma is None or (centered and beta is None):
            return call
        dtype = str(call.ty.dtype)
        w_fold = self.folds.get((weight_arrays.identity(w), gamma.dtype.str, gamma.tobytes()),
                                lambda: weight_arrays.scale_rows(gamma, w), keep=w)
        acc = self.builder_.emit(relax.op.matmul(x, w_fold, out_dtype="float32"))
        if centered:
            mean, rstd = self._get_stats(x, float(norm.attrs.epsilon), True)
            colsum = relax.const(weight_arrays.array(w_fold).astype(np.float64).sum(0).astype("float32"))
            shift = relax.const((beta.astype(np.float64) @ w.astype(np.float64)).astype("float32"))
            acc = relax.op.subtract(acc, relax.op.multiply(mean, colsum))
            out = relax.op.add(relax.op.multiply(acc, rstd), shift)
        else:
            rstd = self._get_stats(x, float(norm.attrs.epsilon), False)
            out = relax.op.multiply(acc, rstd)
        if dtype != "float32":
            out = relax.op.astype(out, dtype)
        self.rewritten += 1
        return out


def _only_matmul_lhs(var, users: dict, outputs: set, steps: tuple[str, ...] = ("astype", "reshape")) -> bool:
    """Every use of ``var`` is a matmul's first operand, through at most one cast back to half
    precision and then reshapes (``steps``: the views still allowed, in order; the legacy ONNX
    exporter writes an identity reshape before the 2-D one)."""
    if var in outputs or not users.get(var):
        return False
    for user_var, call, i in users[var]:
        if _is_op(call, "relax.matmul") and i == 0:
            continue
        passed = next((k for k, step in enumerate(steps) if _is_op(call, f"relax.{step}")), None)
        rest = None if passed is None else steps[passed + (steps[passed] != "reshape"):]
        if rest is not None and _only_matmul_lhs(user_var, users, outputs, rest):
            continue
        return False
    return True


def _norms_used_only_by_gemms(mod: tvm.IRModule) -> list[relax.Call]:
    """Norm calls whose every use is a matmul's first operand, directly or through one reshape."""
    result = []
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        users: dict = {}
        bound: dict = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                bound[binding.var] = binding.value
                if isinstance(binding.value, relax.Call):
                    for i, arg in enumerate(binding.value.args):
                        if isinstance(arg, relax.Var):
                            users.setdefault(arg, []).append((binding.var, binding.value, i))
        outputs = set(relax.analysis.free_vars(func.body.body)) | {func.body.body}

        result += [v for var, v in bound.items() if isinstance(v, relax.Call) and isinstance(
            v.op, tvm.ir.Op) and v.op.name in _NORMS and _only_matmul_lhs(var, users, outputs)]
    return result


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.NormGemmPrologue")
class NormGemmPrologue:
    """matmul(norm(x), W) with constant W and norm params → stats + GEMM with a norm epilogue."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _NormGemm(mod)
        rewriter.only_gemm_users = _norms_used_only_by_gemms(mod)
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                new = rewriter.visit_expr(func)
                rewriter.builder_.update_func(gvar, new)
        mod = relax.transform.DeadCodeElimination()(rewriter.builder_.get())
        # The half-precision norms left (other users than GEMMs) become one kernel each.
        return HalfNormOneKernel()(mod)
