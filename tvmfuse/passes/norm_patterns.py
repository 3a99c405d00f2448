"""Decomposed RMSNorm / LayerNorm / softmax → one ``R.nn`` op each (one kernel after legalisation).

Exporters spell norms out: HF Llama's RMSNorm becomes Pow → ReduceMean → Add → Sqrt → Reciprocal →
Mul → Mul (ONNX) or pow/mean/add/rsqrt/mul/mul (torch.export). TVM's FuseOps then cuts it in two:
a reduction cannot absorb its broadcasting consumer. Rewritten to ``R.nn.rms_norm`` the row is read
once and written once. Only exact forms are rewritten (last-axis reduction, keepdims, scalar eps,
exponent 2, weight over the last axis); anything else is left as it was.

Sits before LegalizeOps (it matches high-level Relax ops).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from ._util import last_axis_only, rewrite_functions, scalar_value, shape_expr, static_shape


def _commutative(op: str, a, b):
    return is_op(op)(a, b) | is_op(op)(b, a)


def _rms_norm_pattern():
    # HF in fp16/bf16 upcasts first and casts the normalised row back before the weight.
    x0, w, eps, two = wildcard(), wildcard(), is_const(), is_const()
    up = is_op("relax.astype")(x0)
    x = up | x0
    square = is_op("relax.power")(x, two) | is_op("relax.multiply")(x, x)
    mean = is_op("relax.mean")(square)
    var_eps = _commutative("relax.add", mean, eps)
    sqrt = is_op("relax.sqrt")(var_eps)
    one = is_const()
    inv = is_op("relax.rsqrt")(var_eps) | is_op("relax.divide")(one, sqrt)
    normed = _commutative("relax.multiply", x, inv) | is_op("relax.divide")(x, sqrt)
    down = is_op("relax.astype")(normed)
    out = _commutative("relax.multiply", down | normed, w)
    return out, dict(x=x0, up=up, down=down, w=w, eps=eps, two=two, mean=mean, one=one, square=square)


def _layer_norm_pattern():
    x, gamma, beta, eps, two = wildcard(), wildcard(), wildcard(), is_const(), is_const()
    mu = is_op("relax.mean")(x)
    centered = is_op("relax.subtract")(x, mu)
    square = is_op("relax.power")(centered, two) | is_op("relax.multiply")(centered, centered)
    var = is_op("relax.mean")(square)
    var_eps = _commutative("relax.add", var, eps)
    normed = (is_op("relax.divide")(centered, is_op("relax.sqrt")(var_eps))
              | _commutative("relax.multiply", centered, is_op("relax.rsqrt")(var_eps)))
    out = _commutative("relax.add", _commutative("relax.multiply", normed, gamma), beta)
    return out, dict(x=x, gamma=gamma, beta=beta, eps=eps, two=two, mu=mu, var=var, square=square)


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


def _rewrite_rms(func: relax.Function) -> relax.Function:
    pattern, p = _rms_norm_pattern()

    def rewriter(expr, m):
        x, w = m[p["x"]], m[p["w"]]
        shape = static_shape(x)
        if shape is None or not _row_vector(w, shape[-1]):
            return expr
        if (p["up"] in m) != (p["down"] in m):
            return expr  # a cast on one side only changes the result's precision: leave it
        if p["up"] in m and not (str(m[p["up"]].attrs.dtype) == "float32"
                                 and str(m[p["down"]].attrs.dtype) == str(x.ty.dtype)):
            return expr  # rms_norm computes in fp32 and returns x's dtype: only that form maps
        if not _reduces_last_keepdims(m[p["mean"]], len(shape)):
            return expr
        if p["two"] in m and m[p["square"]].op.name == "relax.power" and scalar_value(m[p["two"]]) != 2:
            return expr
        if p["one"] in m and scalar_value(m[p["one"]]) != 1:
            return expr
        eps = scalar_value(m[p["eps"]])
        if eps is None or str(x.ty.dtype) != str(w.ty.dtype):
            return expr
        weight = w if len(static_shape(w)) == 1 else relax.op.reshape(w, shape_expr([shape[-1]]))
        return relax.op.nn.rms_norm(x, weight, axes=[-1], epsilon=eps)

    return rewrite_call(pattern, rewriter, func)


def _rewrite_layer_norm(func: relax.Function) -> relax.Function:
    pattern, p = _layer_norm_pattern()

    def rewriter(expr, m):
        x, gamma, beta = m[p["x"]], m[p["gamma"]], m[p["beta"]]
        shape = static_shape(x)
        if shape is None or not (_row_vector(gamma, shape[-1]) and _row_vector(beta, shape[-1])):
            return expr
        if not all(_reduces_last_keepdims(m[p[k]], len(shape)) for k in ("mu", "var")):
            return expr
        if m[p["square"]].op.name == "relax.power" and scalar_value(m[p["two"]]) != 2:
            return expr
        eps = scalar_value(m[p["eps"]])
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
        shape = static_shape(x)
        if shape is None:
            return expr
        if not all(_reduces_last_keepdims(m[p[k]], len(shape)) for k in ("max", "sum")):
            return expr
        return relax.op.nn.softmax(x, axis=-1)

    return rewrite_call(pattern, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.FuseDecomposedNorms")
class FuseDecomposedNorms:
    """Decomposed RMSNorm, LayerNorm and softmax → ``R.nn.rms_norm/layer_norm/softmax``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        # LayerNorm first: its centred half is itself an RMSNorm and would be taken apart.
        for rewrite in (_rewrite_layer_norm, _rewrite_rms, _rewrite_softmax):
            mod = rewrite_functions(mod, rewrite)
        return mod
