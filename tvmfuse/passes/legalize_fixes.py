"""Legalisations that replace broken ones in TVM 0.27, passed to ``LegalizeOps``.

``relax.full`` / ``relax.full_like`` with an inf or NaN fill (``torch.full(..., -inf)`` in every
causal mask) crash in 0.27: the stock rule hands ``topi.full`` a ``PrimType`` where it expects a
dtype string (``"float" in dtype`` → "argument of type 'PrimType' is not iterable").

``relax.nn.softmax`` on fp16/bf16: the stock rule does max, exp and the row sum in half precision
(an fp16 running sum over 4096 terms loses ~3 digits, and TVM's half math converts per op). Ours
casts the row to fp32 in registers, so the kernel reads and writes half but sums in fp32, with
exp2 and one reciprocal per row (half the SASS instructions of topi's fp32 softmax).

``relax.nn.layer_norm`` on bf16: topi's accepts fp32 and fp16 only ("layer_norm: only support float32
and float16"), so a bf16 LayerNorm that is not folded into a GEMM failed to compile. Ours upcasts x, γ
and β in the kernel and runs topi's fp32 LayerNorm, then casts back: one kernel, fp32 statistics.

``relax.max`` / ``relax.min`` on floats: topi starts the reduction at the lowest / highest finite
value, so a row of all −inf reduces to −3.4e38 and ``max(row) == -inf`` (ONNX Attention's
fully-masked-row guard, ``Equal(ReduceMax(bias), -inf) → Where``) is false. Ours starts at ∓inf,
as numpy, torch and onnxruntime::

    max(x, axes) = reduce(max, x, init=−inf);  min(x, axes) = reduce(min, x, init=+inf)

``relax.clip`` on integers with an open side (``torch.clamp(positions, min=0)`` on int64: the
importer passes ``max=inf``) failed to legalise ("Cannot convert infinity to BigInt"). Ours
leaves an infinite side out and rounds a finite float bound into the integers (ceil for the
lower, floor for the upper, as torch compares).

``relax.power`` on bf16: topi's refuses it ("power only applies to float": a bf16 exponent is not a
float type to it), so an RMSNorm's ``x ** 2`` in a model converted to bf16 failed to legalise when
left unfused (the report's op-by-op baseline). Ours raises in fp32 and rounds the result once.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, te, tirx, topi
from tvm.relax.transform.legalize_ops.common import _try_convert_to_scalar_const

from .attention_lower import legalize_attention, register_mixed_precision_fix

register_mixed_precision_fix()  # before any ToMixedPrecision run: 0.27 drops attention's attrs


def _full(is_like: bool):
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        fill = _try_convert_to_scalar_const(call.args[1], python_native=True)
        shape = call.args[0].ty.shape if is_like else call.args[0]
        if not isinstance(shape, relax.ShapeExpr):
            raise NotImplementedError(f"full with a non-static shape {shape} is not supported")
        return bb.call_te(topi.full, shape.values, str(call.ty.dtype), fill,
                          primfunc_name_hint="full")

    return legalize


LOG2E = 1.4426950408889634


def _softmax_fp32_math(x: te.Tensor, dtype: str) -> te.Tensor:
    """softmax over the last axis of ``x`` (…, N): e = 2^((x − max x)·log2 e), y = e · (1 / Σ e).

    fp32 in registers; exp2 is one MUFU.EX2, and the per-row reciprocal replaces a per-element
    IEEE divide (nvcc may not turn ``e / s`` into a multiply itself). Same four stages as topi's
    softmax (max, exp, sum, normalise), which the RowNorm schedule rule recognises.
    """
    *lead, n = x.shape
    f32 = "float32"
    k = te.reduce_axis((0, n), name="k")
    mx = te.compute(tuple(lead), lambda *i: te.max(x[(*i, k)].astype(f32), axis=k),
                    name="T_softmax_maxelem")
    e = te.compute(x.shape, lambda *i: tirx.exp2((x[i].astype(f32) - mx[i[:-1]])
                                                  * tirx.const(LOG2E, f32)), name="T_softmax_exp")
    k2 = te.reduce_axis((0, n), name="k2")
    s = te.compute(tuple(lead), lambda *i: te.sum(e[(*i, k2)], axis=k2), name="T_softmax_expsum")
    return te.compute(x.shape, lambda *i: (e[i] * (tirx.const(1.0, f32) / s[i[:-1]])).astype(dtype),
                      name="T_softmax_norm")


def _softmax(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """Half-precision softmax over the last axis with fp32 math; anything else: the stock rule."""
    x = call.args[0]
    dtype, ndim = str(x.ty.dtype), x.ty.ndim
    if dtype not in ("float16", "bfloat16") or int(call.attrs.axis) not in (-1, ndim - 1):
        return tvm.ir.Op.get("relax.nn.softmax").get_attr("FLegalize")(bb, call)
    return bb.call_te(_softmax_fp32_math, x, dtype, primfunc_name_hint="softmax")


def _layer_norm_fp32_math(x: te.Tensor, gamma: te.Tensor, beta: te.Tensor, axes, eps: float):
    """``half(layer_norm(float(x), float(γ), float(β)))``: topi's fp32 LayerNorm on upcast inputs."""
    f32 = "float32"
    y = topi.nn.layer_norm(topi.cast(x, f32), topi.cast(gamma, f32), topi.cast(beta, f32),
                           axis=axes, epsilon=eps)
    return topi.cast(y, x.dtype)


def _layer_norm(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """bf16 LayerNorm with fp32 math; anything else: the stock rule."""
    if str(call.args[0].ty.dtype) != "bfloat16":
        return tvm.ir.Op.get("relax.nn.layer_norm").get_attr("FLegalize")(bb, call)
    return bb.call_te(_layer_norm_fp32_math, *call.args, call.attrs.axes, float(call.attrs.epsilon),
                      primfunc_name_hint="layer_norm")


def _relu_nan_propagating(x: te.Tensor) -> te.Tensor:
    """relu(x) = x < 0 ? 0 : x, so relu(NaN) = NaN as in torch, numpy and onnxruntime."""
    zero = tirx.const(0, x.dtype)
    return te.compute(x.shape, lambda *i: tirx.Select(x(*i) < zero, zero, x(*i)), name="compute",
                      tag="elemwise")


def _relu(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """Float ReLU that keeps NaN; integers: the stock rule."""
    if not str(call.args[0].ty.dtype).startswith(("float", "bfloat")):
        return tvm.ir.Op.get("relax.nn.relu").get_attr("FLegalize")(bb, call)
    return bb.call_te(_relu_nan_propagating, call.args[0], primfunc_name_hint="relu")


def _power_bf16(x: te.Tensor, y) -> te.Tensor:
    """``x ** y`` for bf16 ``x`` and a bf16 tensor or float ``y``: computed in fp32, rounded to
    bf16; one elementwise block for a scalar ``y`` (a GEMM epilogue can take it)."""
    f32 = "float32"
    if isinstance(y, float):
        return te.compute(x.shape, lambda *i: tirx.pow(x(*i).astype(f32), tirx.const(y, f32))
                          .astype("bfloat16"), name="power", tag="elemwise")
    return topi.cast(topi.power(topi.cast(x, f32), topi.cast(y, f32)), "bfloat16")


def _power(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """bf16 ``power`` through fp32; every other dtype: the stock rule."""
    if str(call.ty.dtype) != "bfloat16":
        return tvm.ir.Op.get("relax.power").get_attr("FLegalize")(bb, call)
    x, y = call.args
    scalar = _try_convert_to_scalar_const(y, python_native=True)
    if isinstance(scalar, (int, float)):
        return bb.call_te(_power_bf16, x, float(scalar), primfunc_name_hint="power")
    return bb.call_te(_power_bf16, x, y, primfunc_name_hint="power")


def _infinite_reducer(is_max: bool):
    def identity(dtype: str) -> tirx.PrimExpr:
        return tirx.const(-math.inf if is_max else math.inf, dtype)

    def combine(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.max(a, b) if is_max else tirx.min(a, b)

    return te.comm_reducer(combine, identity,
                           name="max_inf" if is_max else "min_inf")


def _reduce_from_inf(x: te.Tensor, axes: list[int], keepdims: bool, is_max: bool) -> te.Tensor:
    """max / min of ``x`` over ``axes`` (normalised, sorted) with ∓inf as the identity."""
    reducer = _infinite_reducer(is_max)
    raxes = {a: te.reduce_axis((0, x.shape[a]), name=f"k{a}") for a in axes}
    shape = [1 if d in raxes else x.shape[d] for d in range(len(x.shape)) if keepdims or d not in raxes]

    def body(*out):
        pos, index = 0, []
        for d in range(len(x.shape)):
            if d in raxes:
                index.append(raxes[d])
                pos += keepdims
            else:
                index.append(out[pos])
                pos += 1
        return reducer(x[tuple(index)], axis=list(raxes.values()))

    return te.compute(shape, body, name="max_red" if is_max else "min_red")


def _extremum(is_max: bool):
    op = "relax.max" if is_max else "relax.min"

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        x = call.args[0]
        if not str(x.ty.dtype).startswith(("float", "bfloat")):
            return tvm.ir.Op.get(op).get_attr("FLegalize")(bb, call)
        ndim = x.ty.ndim
        axes = sorted({int(a) % ndim for a in call.attrs.axis} if call.attrs.axis is not None
                      else range(ndim))
        return bb.call_te(_reduce_from_inf, x, axes, bool(call.attrs.keepdims), is_max,
                          primfunc_name_hint="max" if is_max else "min")

    return legalize


def _clip_int(x: te.Tensor, lo: int | None, hi: int | None) -> te.Tensor:
    """``min(max(x, lo), hi)`` with a side left out where its bound is None."""
    def body(*i):
        v = x(*i)
        if lo is not None:
            v = tirx.max(v, tirx.const(lo, x.dtype))
        if hi is not None:
            v = tirx.min(v, tirx.const(hi, x.dtype))
        return v

    return te.compute(x.shape, body, name="clip", tag="elemwise")


def _clip(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """Integer clip with infinite or fractional bounds; floats and symbolic bounds: the stock rule."""
    x = call.args[0]
    stock = tvm.ir.Op.get("relax.clip").get_attr("FLegalize")
    if str(x.ty.dtype).startswith(("float", "bfloat")):
        return stock(bb, call)
    bounds = [getattr(_try_convert_to_scalar_const(b, python_native=True), "value", b)
              for b in call.args[1:3]]  # (0.27: the bounds are IntImm / FloatImm)
    if not all(isinstance(b, (int, float)) for b in bounds):
        return stock(bb, call)
    lo, hi = bounds
    lo = None if math.isinf(lo) else math.ceil(lo)
    hi = None if math.isinf(hi) else math.floor(hi)
    return bb.call_te(_clip_int, x, lo, hi, primfunc_name_hint="clip")


def legalize_overrides() -> dict:
    """``{op name: legalize function}`` for ``relax.transform.LegalizeOps``."""
    return {"relax.full": _full(False), "relax.full_like": _full(True), "relax.nn.softmax": _softmax,
            "relax.nn.attention": legalize_attention, "relax.nn.attention_bias": legalize_attention,
            "relax.nn.layer_norm": _layer_norm, "relax.nn.relu": _relu,
            "relax.max": _extremum(True), "relax.min": _extremum(False), "relax.clip": _clip,
            "relax.power": _power}
