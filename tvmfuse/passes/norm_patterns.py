"""Decomposed RMSNorm / LayerNorm / softmax → one ``R.nn`` op each (one kernel after legalisation).

Exporters spell norms out: HF Llama's RMSNorm becomes Pow → ReduceMean → Add → Sqrt → Reciprocal →
Mul → Mul (ONNX) or pow/mean/add/rsqrt/mul/mul (torch.export); where eps is too small to
change the fp32 statistic the dynamo ONNX exporter drops the Add (Helium's 1e-8: ``Sqrt(mean)``),
which is eps = 0 here. TVM's FuseOps then cuts it in two:
a reduction cannot absorb its broadcasting consumer. Rewritten to ``R.nn.rms_norm`` the row is read
once and written once. Only exact forms are rewritten (last-axis reduction, keepdims, scalar eps,
exponent 2, weight over the last axis); anything else is left as it was.

Sits before LegalizeOps (it matches high-level Relax ops).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from ._util import (
    dataflow_bindings,
    folded_constant,
    known_shape,
    last_axis_only,
    rewrite_functions,
    scalar_value,
    shape_expr,
    static_shape,
    without_large_constants,
)


def _commutative(op: str, a, b):
    return is_op(op)(a, b) | is_op(op)(b, a)


def _over_sqrt(x, var_eps):
    """``x / sqrt(v)``, ``x · rsqrt(v)`` or ``x · (1 / sqrt(v))`` (ONNX's Reciprocal of Sqrt):
    (the pattern, the constant that must be 1)."""
    one = is_const()
    sqrt = is_op("relax.sqrt")(var_eps)
    inv = is_op("relax.rsqrt")(var_eps) | is_op("relax.divide")(one, sqrt)
    return _commutative("relax.multiply", x, inv) | is_op("relax.divide")(x, sqrt), one


def _rms_norm_pattern(weighted: bool = True):
    # In fp16/bf16, HF upcasts first (torch.export may spell ``x.float()`` twice: one cast for the
    # square, one for the product) and multiplies by the weight after the cast back (Llama, T5) or
    # in fp32 before it (Gemma's ``1 + w``, F.rms_norm, nn.RMSNorm). Without a weight (NanoChat's
    # ``F.rms_norm(x, (n,))``) the pattern ends at x̂: a cast back stays after the norm.
    x0, w, eps, two = wildcard(), wildcard(), is_const(), is_const()
    up_sq, up_mul = is_op("relax.astype")(x0), is_op("relax.astype")(x0)
    xs, xm = up_sq | x0, up_mul | x0
    square = is_op("relax.power")(xs, two) | is_op("relax.multiply")(xs, xs)
    mean = is_op("relax.mean")(square)
    normed, one = _over_sqrt(xm, _commutative("relax.add", mean, eps) | mean)  # no add: eps 0
    down = is_op("relax.astype")(normed)
    out = _commutative("relax.multiply", down | normed, w) if weighted else normed
    return out, dict(x=x0, up_sq=up_sq, up_mul=up_mul, down=down, w=w, eps=eps, two=two, mean=mean,
                     one=one, square=square)


def _layer_norm_pattern(weighted: bool = True):
    # Also without β (Cohere's and OLMo's LayerNorm: ``w · (x − μ) · rsqrt(var + eps)``), without γ
    # and β (``weighted=False``), and in fp16/bf16 modules on the fp32 upcast of x (the cast back,
    # if any, stays after the norm).
    x, gamma, beta, eps, two = wildcard(), wildcard(), wildcard(), is_const(), is_const()
    mu = is_op("relax.mean")(x)
    # ``x − μ`` once, or twice (torch.export keeps the two ``h - mean`` of Cohere's code apart)
    centered, again = is_op("relax.subtract")(x, mu), is_op("relax.subtract")(x, mu)
    square = is_op("relax.power")(centered, two) | is_op("relax.multiply")(centered, centered)
    var = is_op("relax.mean")(square)
    normed, one = _over_sqrt(again, _commutative("relax.add", var, eps) | var)  # no add: eps 0
    scaled = _commutative("relax.multiply", normed, gamma)
    out = (_commutative("relax.add", scaled, beta) | scaled) if weighted else normed
    return out, dict(x=x, gamma=gamma, beta=beta, eps=eps, two=two, mu=mu, var=var, square=square,
                     one=one)


def _softmax_pattern():
    x = wildcard()
    mx = is_op("relax.max")(x)
    e = is_op("relax.exp")(is_op("relax.subtract")(x, mx))
    total = is_op("relax.sum")(e)
    out = is_op("relax.divide")(e, total)
    return out, dict(x=x, max=mx, sum=total)


def _row_vector(expr, n: int) -> bool:
    shape = static_shape(expr)
    return shape is not None and shape[-1:] == [n] and all(d == 1 for d in shape[:-1])


def _reduces_last_keepdims(call, ndim: int) -> bool:
    return last_axis_only(call.attrs.axis, ndim) and bool(call.attrs.keepdims)


def _row_weight(w: relax.Expr, n: int, lookup) -> relax.Expr:
    """``w`` as a 1-D row of ``n``: folded to a constant when built only from constants."""
    value = None if isinstance(w, tvm.ir.expr.Constant) else folded_constant(w, lookup)
    if value is not None:
        return relax.const(value.reshape(n), str(value.dtype))
    return w if len(static_shape(w)) == 1 else relax.op.reshape(w, shape_expr([n]))


def _rms_input(m: dict, p: dict) -> relax.Expr | None:
    """The tensor ``rms_norm`` takes for this match, else None when no ``rms_norm`` computes it.

    Upcast on both branches, the weight applied after the cast back (``w ⊙ half(x̂)``):
    ``rms_norm(x, w)`` (statistics in fp32, one rounding less). Upcast, weight applied in fp32:
    ``rms_norm(float(x), w)``, the cast back (if any) left where it is. No casts: ``x``.
    """
    x = m[p["x"]]
    casts = [p[k] in m for k in ("up_sq", "up_mul")]
    if casts[0] != casts[1] or any(str(m[p[k]].attrs.dtype) != "float32" for k in ("up_sq", "up_mul")
                                   if p[k] in m):
        return None  # the square and the product would see x at different precisions
    if p["down"] in m:
        down_to_x = str(m[p["down"]].attrs.dtype) == str(x.ty.dtype)
        return x if casts[0] and down_to_x else None
    return m[p["up_mul"]] if casts[0] else x


def _ones(n: int, dtype: str) -> relax.Constant:
    return relax.const(np.ones(n, dtype), dtype)


def _rewrite_rms(func: relax.Function, weighted: bool = True) -> relax.Function:
    pattern, p = _rms_norm_pattern(weighted)
    bound, _ = dataflow_bindings(func)

    def rewriter(expr, m):
        data = _rms_input(m, p)
        shape = None if data is None else known_shape(data)  # leading dims may be symbolic
        if shape is None or not isinstance(shape[-1], int):
            return expr
        w = m[p["w"]] if weighted else _ones(shape[-1], str(data.ty.dtype))
        if not _row_vector(w, shape[-1]):
            return expr
        if not _reduces_last_keepdims(m[p["mean"]], len(shape)):
            return expr
        if p["two"] in m and m[p["square"]].op.name == "relax.power" and scalar_value(m[p["two"]]) != 2:
            return expr
        if p["one"] in m and scalar_value(m[p["one"]]) != 1:
            return expr
        eps = scalar_value(m[p["eps"]]) if p["eps"] in m else 0.0
        if eps is None or str(data.ty.dtype) != str(w.ty.dtype):
            return expr
        weight = _row_weight(w, shape[-1], lambda e: bound.get(e, e))
        return relax.op.nn.rms_norm(data, weight, axes=[-1], epsilon=eps)

    return rewrite_call(pattern, rewriter, func)


def _rewrite_layer_norm(func: relax.Function, weighted: bool = True) -> relax.Function:
    pattern, p = _layer_norm_pattern(weighted)

    def rewriter(expr, m):
        x = m[p["x"]]
        shape = known_shape(x)
        if shape is None or not isinstance(shape[-1], int):
            return expr
        gamma = m[p["gamma"]] if weighted else _ones(shape[-1], str(x.ty.dtype))
        # no β: zeros of γ's dtype (the kernel adds it; NormGemmPrologue folds it into the bias)
        beta = m[p["beta"]] if p["beta"] in m else relax.const(
            np.zeros(shape[-1], str(gamma.ty.dtype)), str(gamma.ty.dtype))
        if not (_row_vector(gamma, shape[-1]) and _row_vector(beta, shape[-1])):
            return expr
        dtypes = {str(v.ty.dtype) for v in (x, gamma, beta)}
        if len(dtypes) != 1:
            return expr  # (γ in fp32 on a half x: the upcast is x itself here, so they agree)
        if not all(_reduces_last_keepdims(m[p[k]], len(shape)) for k in ("mu", "var")):
            return expr
        if m[p["square"]].op.name == "relax.power" and scalar_value(m[p["two"]]) != 2:
            return expr
        if p["one"] in m and scalar_value(m[p["one"]]) != 1:
            return expr
        eps = scalar_value(m[p["eps"]]) if p["eps"] in m else 0.0
        if eps is None:
            return expr
        gamma, beta = (v if len(static_shape(v)) == 1 else relax.op.reshape(v, shape_expr([shape[-1]]))
                       for v in (gamma, beta))
        return relax.op.nn.layer_norm(x, gamma, beta, axes=[-1], epsilon=eps)

    return rewrite_call(pattern, rewriter, func)


def _rewrite_softmax(func: relax.Function) -> relax.Function:
    pattern, p = _softmax_pattern()

    def rewriter(expr, m):
        x = m[p["x"]]
        shape = known_shape(x)
        if shape is None:
            return expr
        if not all(_reduces_last_keepdims(m[p[k]], len(shape)) for k in ("max", "sum")):
            return expr
        return relax.op.nn.softmax(x, axis=-1)

    return rewrite_call(pattern, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.FuseDecomposedNorms")
class FuseDecomposedNorms:
    """Decomposed RMSNorm, LayerNorm (with or without a weight) and softmax →
    ``R.nn.rms_norm/layer_norm/softmax`` (ones for a missing weight, zeros for a missing β)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        # LayerNorm first: its centred half is itself an RMSNorm and would be taken apart. The
        # weightless forms after the weighted ones: their x̂ is inside every weighted match.
        for rewrite in (_rewrite_layer_norm, _rewrite_rms, partial(_rewrite_layer_norm, weighted=False),
                        partial(_rewrite_rms, weighted=False), _rewrite_softmax):
            mod = rewrite_functions(mod, without_large_constants(rewrite))  # γ, β, eps are small
        return mod
