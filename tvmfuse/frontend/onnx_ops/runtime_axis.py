"""``CumSum`` / ``CumProd`` / ``DFT`` (opset 20) with the ``axis`` input a runtime scalar.

``axis`` takes one of ``r`` values (``[-R, r)``, R the rank; ``DFT``'s last axis holds re / im
and is no signal axis), so each candidate is computed by the op's constant-axis converter and
the one asked for is selected at run time::

    out = where(a == 0, op_0(x), where(a == 1, op_1(x), … op_{r-1}(x)))
    a   = axis mod R      (a outside [0, r), or an axis the converter refuses or whose output is
                       empty: the call fails)

Candidates of different static shapes (a DFT along axes of different lengths) are zero-padded to
the largest, selected the same way, and cut back to the chosen one's shape, a symbolic shape
bound at run time. ``r`` computations instead of one: correct at any axis, cheap for the small
tensors this form meets.
"""

from __future__ import annotations

import numpy as np
import tvm_ffi
from tvm import relax, te, tirx

from ...errors import UnsupportedOpError
from ...relax_shapes import static_shape
from .runtime_values import Fallback, Handler, checked, int64, normalized_axes, scalar, symbolic_dims


def _padded(bb: relax.BlockBuilder, x: relax.Expr, shape: list[int]) -> relax.Expr:
    """``x`` zero-padded at the end of each axis to ``shape`` (one TE kernel)."""

    def pad(data: te.Tensor) -> te.Tensor:
        return te.compute(shape, lambda *i: tirx.if_then_else(
            tirx.all(*[v < d for v, d in zip(i, data.shape, strict=True)]),
            data(*[tirx.min(v, d - 1) for v, d in zip(i, data.shape, strict=True)]),
            tirx.const(0, data.dtype)), name="pad_to")

    return bb.emit_te(pad, x)


def _leading(bb: relax.BlockBuilder, x: relax.Expr, dims: list[tirx.PrimExpr]) -> relax.Expr:
    """``x[:d0, :d1, …]`` with symbolic extents ``dims`` (one TE kernel)."""

    def window(data: te.Tensor, *extent: tirx.PrimExpr) -> te.Tensor:
        return te.compute(list(extent), lambda *i: data(*i), name="leading")

    return bb.emit_te(window, x, *dims)


def _select(a: relax.Expr, values: list[relax.Expr], keys: list[int] | None = None) -> relax.Expr:
    """``values[i]`` where ``a == keys[i]`` (keys: 0, 1, …; ``a`` an int64 scalar tensor; the
    last value when none matches)."""
    keys = list(range(len(values))) if keys is None else keys
    out = values[-1]
    for key, value in zip(reversed(keys[:-1]), reversed(values[:-1]), strict=True):
        out = relax.op.where(relax.op.equal(a, int64(key)), value, out)
    return out


def _any_of(a: relax.Expr, keys: list[int]) -> relax.Expr:
    """``a`` (an int64 scalar tensor) is one of ``keys`` (a bool scalar)."""
    keys_t = relax.const(np.array(keys, "int64"), "int64")
    return relax.op.greater(relax.op.sum(relax.op.astype(relax.op.equal(keys_t, a), "int64")), int64(0))


def runtime_axis_choice(op: str, index: int, reserved: int = 0) -> Handler:
    """The handler of ``op`` whose input ``index`` is the axis, the last ``reserved`` axes of
    the data (input 0) excluded."""

    def convert(bb: relax.BlockBuilder, inputs: list, attr: dict, fallback: Fallback) -> relax.Expr:
        data = inputs[0]
        rank = data.ty.ndim
        count = rank - reserved
        if count < 1:
            raise ValueError(f"{op}: a runtime axis needs data of known rank > {reserved}, got {data.ty}")
        a = bb.normalize(normalized_axes(scalar(bb, inputs[index]), rank))
        axes, candidates = [], []
        for k in range(count):
            new = list(inputs)
            new[index] = relax.const(np.int64(k), "int64")
            try:
                candidate = bb.normalize(fallback(new))
            except (ValueError, UnsupportedOpError):  # an axis the op refuses: the call fails there
                continue
            if 0 not in (static_shape(candidate) or ()):
                axes.append(k)
                candidates.append(candidate)
        if not candidates:
            raise ValueError(f"{op}: no axis of {data.ty} has an output")
        ok = bb.normalize(_any_of(a, axes))
        a = bb.normalize(_select(a, [int64(k) for k in range(len(axes))], axes))
        if all(tvm_ffi.structural_equal(c.ty, candidates[0].ty) for c in candidates):
            return checked(bb, _select(a, candidates), ok)
        shapes = [static_shape(c) for c in candidates]
        if any(s is None or len(s) != len(shapes[0]) for s in shapes):
            raise ValueError(f"{op}: a runtime axis whose outputs differ in rank or are dynamic")
        full = [max(d) for d in zip(*shapes, strict=True)]
        chosen = _select(a, [_padded(bb, c, full) for c in candidates])
        sizes = _select(a, [relax.const(np.array(s, "int64"), "int64") for s in shapes])
        dims = symbolic_dims(bb, sizes, len(full), "axis_out", ok)
        return _leading(bb, bb.normalize(chosen), dims)

    return convert


cumsum_runtime_axis = runtime_axis_choice("CumSum", 1)
cumprod_runtime_axis = runtime_axis_choice("CumProd", 1)
dft_runtime_axis = runtime_axis_choice("DFT", 2, reserved=1)
