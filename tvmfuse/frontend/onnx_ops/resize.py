"""ONNX ``Resize`` (opset 18+) with ``scales`` or ``sizes`` a runtime tensor.

As the ONNX reference does, the resize is separable: one pass per resized axis (the ``axes``
attribute's, else every axis), in that order. Per axis of input length ``n``, scale ``s`` and
output length ``m`` (a symbolic dim bound at run time)::

    m = floor(s·n)                        (scales)       s = m / n                   (sizes)
    keep_aspect_ratio_policy not_larger / not_smaller: s = min / max of m_k / n_k over the axes,
    m = floor(s·n + 0.5)
    x(o)  = the source coordinate of output o (coordinate_transformation_mode, float64)
    b     = floor(x), one less when x is an integer; r = x - b ∈ (0, 1]
    out[o] = Σ_{t<T} w(o, t) · in[clamp(b + 1 - T/2 + t, 0, n - 1)]

with the ``T`` taps ``w`` of ``mode``: nearest (2; by ``nearest_mode``), linear (2; triangle),
cubic (4; Keys kernel with ``cubic_coeff_a``); with ``antialias`` the kernel is stretched by
1/min(s, 1) (``T`` then depends on ``s``: a symbolic dim too) and normalised; with
``exclude_outside`` taps outside [0, n) get weight 0 and the rest are renormalised;
``tf_crop_and_resize`` writes ``extrapolation_value`` where x falls outside [0, n - 1].
Sizes or scales that are not positive fail the call. Only float data (nearest: any).
"""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx

from ...relax_shapes import static_shape
from .runtime_values import Fallback, all_of, dims_tensor, int64, spread, static_length, symbolic_dims

_F64 = "float64"
_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
          "tf_crop_and_resize")


def _text(attr: dict, name: str, default: str) -> str:
    value = attr.get(name, default)
    return value.decode() if isinstance(value, bytes) else value


def _f64(value) -> tirx.PrimExpr:
    return tirx.Cast(_F64, value)


def _source(mode: str, o: tirx.PrimExpr, s: tirx.PrimExpr, n: int, m: tirx.PrimExpr,
            roi: tuple[tirx.PrimExpr, tirx.PrimExpr]) -> tirx.PrimExpr:
    """x(o): the input coordinate of output index ``o`` (float64)."""
    of, nf, width = _f64(o), tirx.const(float(n), _F64), s * float(n)  # width: ONNX's output_width
    one, half = tirx.const(1.0, _F64), tirx.const(0.5, _F64)
    if mode == "align_corners":
        return tirx.Select(width == one, tirx.const(0.0, _F64), of * (nf - one) / (width - one))
    if mode == "asymmetric":
        return of / s
    if mode == "tf_crop_and_resize":
        span = roi[1] - roi[0]
        inner = tirx.Select(width == one, span * (nf - one) / 2.0, of * span * (nf - one) / (width - one))
        return inner + roi[0] * (nf - one)
    if mode == "pytorch_half_pixel":
        return tirx.Select(width == one, -half, (of + half) / s - half)
    if mode == "half_pixel_symmetric":
        offset = nf / 2.0 * (one - _f64(m) / width)
        return offset + (of + half) / s - half
    return (of + half) / s - half


def _cubic(x: tirx.PrimExpr, a: float) -> tirx.PrimExpr:
    x = tirx.abs(x)
    x2, x3 = x * x, x * x * x
    near = (a + 2) * x3 - (a + 3) * x2 + 1.0
    far = a * x3 - 5 * a * x2 + 8 * a * x - 4 * a
    return tirx.Select(x <= 1.0, near, tirx.Select(x < 2.0, far, tirx.const(0.0, _F64)))


def _nearest(rule: str, t: tirx.PrimExpr, ratio: tirx.PrimExpr) -> tirx.PrimExpr:
    """Weight of tap ``t`` ∈ {0: b, 1: b + 1} under ``nearest_mode`` ``rule`` (float64)."""
    one = tirx.const(1.0, _F64)
    first = {"round_prefer_floor": ratio <= 0.5, "round_prefer_ceil": ratio < 0.5,
             "floor": tirx.const(True, "bool"), "ceil": tirx.const(False, "bool")}[rule]
    pick = tirx.Select(ratio == one, t == 1, tirx.Select(first, t == 0, t == 1))
    return tirx.Select(pick, one, tirx.const(0.0, _F64))


def _resize_axis(x: te.Tensor, scales: te.Tensor, roi: te.Tensor, out_len: tirx.PrimExpr,
                 taps: tirx.PrimExpr, *, axis: int, rank: int, mode: str, coord: str,
                 nearest: str, a: float, antialias: bool, exclude: bool, extrapolation: float,
                 acc: str) -> te.Tensor:
    """One separable pass of Resize along ``axis`` (see the module docstring)."""
    n = int(x.shape[axis])
    s = scales[axis]
    shrink = tirx.min(s, 1.0) if antialias else tirx.const(1.0, _F64)
    lo = 1 - taps // 2

    def place(o):
        xo = _source(coord, o, s, n, out_len, (roi[axis], roi[rank + axis]))
        fl = tirx.floor(xo)
        base = tirx.Select(fl == xo, fl - 1.0, fl)
        return xo, base, xo - base

    def raw(o, t):
        _, base, ratio = place(o)
        arg = (_f64(lo + t) - ratio) * shrink
        if mode == "linear":
            w = tirx.max(1.0 - tirx.abs(arg), 0.0)
        elif mode == "cubic":
            w = _cubic(arg, a)
        else:
            w = _nearest(nearest, t, ratio)
        if exclude:
            src = tirx.Cast("int64", base) + lo + t
            w = tirx.Select(tirx.all(src >= 0, src < n), w, tirx.const(0.0, _F64))
        return w

    weights = te.compute([out_len, taps], raw, name="weights")
    if antialias or exclude:
        t = te.reduce_axis((0, taps), "t")
        total = te.compute([out_len], lambda o: te.sum(weights[o, t], axis=t), name="total")
        weights = te.compute([out_len, taps], lambda o, k: weights[o, k] / tirx.Select(
            total[o] == 0.0, tirx.const(1.0, _F64), total[o]), name="normalised")

    shape = [*x.shape[:axis], out_len, *x.shape[axis + 1:]]

    def body(*i):
        o = i[axis]
        _, base, _ = place(o)
        t = te.reduce_axis((0, taps), "tap")
        src = tirx.max(tirx.min(tirx.Cast("int64", base) + lo + t, n - 1), 0)
        return te.sum(tirx.Cast(acc, weights[o, t]) * tirx.Cast(acc, x(*i[:axis], src, *i[axis + 1:])),
                      axis=t)

    summed = te.compute(shape, body, name="resized")
    if coord != "tf_crop_and_resize":
        return summed

    def clip(*i):
        xo, _, _ = place(i[axis])
        outside = tirx.any(xo < 0.0, xo > float(n - 1))
        return tirx.Select(outside, tirx.const(extrapolation, acc), summed(*i))

    return te.compute(shape, clip, name="extrapolated")


def resize_runtime(bb: relax.BlockBuilder, inputs: list, attr: dict, fallback: Fallback) -> relax.Expr:
    """``Resize(X, roi, scales, sizes)`` with ``scales`` or ``sizes`` a runtime tensor."""
    data = inputs[0]
    shape = static_shape(data)
    mode, coord = _text(attr, "mode", "nearest"), _text(attr, "coordinate_transformation_mode", "half_pixel")
    nearest, policy = _text(attr, "nearest_mode", "round_prefer_floor"), _text(
        attr, "keep_aspect_ratio_policy", "stretch")
    antialias = bool(attr.get("antialias", 0))
    dtype = str(data.ty.dtype)
    floating = dtype.startswith(("float", "bfloat"))
    if (shape is None or not shape or mode not in ("nearest", "linear", "cubic") or coord not in _MODES
            or (mode == "nearest" and antialias) or (not floating and mode != "nearest")
            or policy not in ("stretch", "not_larger", "not_smaller")):
        raise ValueError(f"Resize with runtime scales / sizes: unsupported combination (data {data.ty}, "
                         f"mode {mode}, coordinate_transformation_mode {coord}, antialias {antialias})")
    rank = len(shape)
    axes = [a % rank for a in attr.get("axes", range(rank))]
    roi, scales = (inputs[i] if len(inputs) > i else None for i in (1, 2))
    sizes = inputs[3] if len(inputs) > 3 else None
    given_sizes = sizes is not None and static_length(sizes) != 0
    dims = relax.op.astype(dims_tensor(data), _F64)
    if given_sizes:
        wanted = relax.op.astype(spread(relax.op.astype(sizes, "int64"), axes, rank, dims_tensor(data)), _F64)
        ratio = relax.op.divide(wanted, dims)
        if policy != "stretch":
            picked = relax.op.take(ratio, relax.const(np.array(axes, "int64"), "int64"), axis=0)
            one = (relax.op.min if policy == "not_larger" else relax.op.max)(picked)
            on_axes = relax.const(np.isin(np.arange(rank), axes), "bool")
            ratio = relax.op.where(on_axes, relax.op.broadcast_to(one, [rank]), relax.const(1.0, _F64))
            wanted = relax.op.where(on_axes, relax.op.floor(relax.op.add(
                relax.op.multiply(ratio, dims), relax.const(0.5, _F64))), dims)
        out = relax.op.astype(wanted, "int64")
    else:
        ratio = spread(relax.op.astype(scales, _F64), axes, rank, relax.const(np.ones(rank), _F64))
        out = relax.op.astype(relax.op.floor(relax.op.multiply(ratio, dims)), "int64")
    ratio = bb.normalize(ratio)
    support = 2.0 if mode == "cubic" else 1.0
    if antialias:  # T = 2 - 2·(floor(-support / min(s, 1)) + 1)
        start = relax.op.add(relax.op.floor(relax.op.divide(relax.const(-support, _F64), relax.op.minimum(
            ratio, relax.const(1.0, _F64)))), relax.const(1.0, _F64))
        taps = relax.op.astype(relax.op.subtract(relax.const(2.0, _F64), relax.op.multiply(
            relax.const(2.0, _F64), start)), "int64")
    else:
        taps = relax.const(np.full(rank, 2 * int(support) if mode != "nearest" else 2, "int64"), "int64")
    ok = relax.op.logical_and(all_of(relax.op.greater(ratio, relax.const(0.0, _F64))),
                              all_of(relax.op.greater_equal(out, int64(0))))
    syms = symbolic_dims(bb, relax.op.concat([out, taps], axis=0), 2 * rank, "resize", bb.normalize(ok))
    if roi is not None and static_length(roi) not in (None, 0):
        roi64 = spread(relax.op.astype(roi, _F64), axes + [rank + a for a in axes], 2 * rank,
                      relax.const(np.array([0.0] * rank + [1.0] * rank), _F64))
    else:
        roi64 = relax.const(np.array([0.0] * rank + [1.0] * rank), _F64)
    acc = "float32" if floating and dtype != _F64 else _F64  # ints: exact in float64 up to 2**53
    result = data if dtype == acc else bb.normalize(relax.op.astype(data, acc))
    options = {"rank": rank, "mode": mode, "coord": coord, "nearest": nearest,
               "a": float(attr.get("cubic_coeff_a", -0.75)), "antialias": antialias,
               "exclude": bool(attr.get("exclude_outside", 0)),
               "extrapolation": float(attr.get("extrapolation_value", 0.0)), "acc": acc}
    roi64 = bb.normalize(roi64)
    for axis in axes:
        # A named kernel: a lambda's "<lambda>" would become the CUDA kernel's (invalid) name.
        result = bb.emit_te(lambda *args, axis=axis: _resize_axis(*args, axis=axis, **options),
                            result, ratio, roi64, syms[axis], syms[rank + axis],
                            primfunc_name_hint=f"resize_axis{axis}")
    if dtype != acc:
        result = relax.op.astype(relax.op.round(result) if not floating else result, dtype)
    return result
