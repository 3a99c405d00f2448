"""ONNX ``STFT`` (opset 17), forward: windowed frames of a real or complex signal, each DFT'd.

signal (B, N, 1 | 2), frame_step s, window w (L) or frame_length L (default N), onesided (1)::

    F        = 1 + (N − L) // s                      frames
    K        = L // 2 + 1 (onesided) | L              bins
    Y[b, f, k] = Σ_{t<L} w[t]·x[b, f·s + t]·e^(−2πi·(k·t mod L)/L)      → (B, F, K, 2) re / im

``frame_step`` and ``frame_length`` may be runtime scalars: s, L, F and K are then symbolic dims
bound at run time (s ≥ 1 and 1 ≤ L ≤ N checked, and L equal to the window's length when both
are given). One TE reduction, accumulated in float64.
"""

from __future__ import annotations

import math

from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape
from ._common import refuse
from .runtime_values import int64, scalar, symbolic_dims


def _stft(x: te.Tensor, window: te.Tensor | None, step: tirx.PrimExpr, length: tirx.PrimExpr,
          frames: tirx.PrimExpr, bins: tirx.PrimExpr) -> te.Tensor:
    """(B, F, K, 2) of the module docstring."""
    complex_in = int(x.shape[2]) == 2
    t = te.reduce_axis((0, length), "t")
    wide = "float64"

    def value(b, f, k, part):
        pos = f * step + t
        re = x[b, pos, 0].astype(wide)
        im = x[b, pos, 1].astype(wide) if complex_in else tirx.const(0.0, wide)
        weight = window[t].astype(wide) if window is not None else tirx.const(1.0, wide)
        phase = tirx.floormod(k.astype("int64") * t.astype("int64"), length).astype(wide)
        theta = tirx.const(2 * math.pi, wide) * phase / length.astype(wide)
        cos, sin = tirx.cos(theta), tirx.sin(theta)
        term = tirx.Select(part == 0, re * cos + im * sin, im * cos - re * sin)
        return te.sum(weight * term, axis=t)

    out = te.compute((x.shape[0], frames, bins, 2), value, name="stft_sum")
    return te.compute(out.shape, lambda *i: out(*i).astype(x.dtype), name="stft")


class STFT(stock.OnnxOpConverter):
    """Forward ``STFT`` of a static-shape signal; step / length constant or runtime."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        inputs = list(inputs) + [None] * (4 - len(inputs))
        signal, step, window, length = inputs[:4]
        shape = static_shape(signal)
        if shape is None or len(shape) != 3 or shape[2] not in (1, 2) or \
                not str(signal.ty.dtype).startswith("float"):
            raise refuse(attr, "STFT", f"signal {signal.ty} (float (B, N, 1 | 2) of static shape)")
        n = shape[1]
        window_length = static_shape(window)[0] if window is not None else None
        if window is not None and window_length is None:
            raise refuse(attr, "STFT", "a window of dynamic length")
        s = scalar(bb, step)
        if window_length is not None:
            frame = int64(window_length)
            same = relax.op.equal(scalar(bb, length), frame) if length is not None else relax.const(True)
        else:
            frame = scalar(bb, length) if length is not None else int64(n)
            same = relax.const(True)
        frames = relax.op.add(relax.op.floor_divide(relax.op.subtract(int64(n), frame), s), int64(1))
        half = relax.op.add(relax.op.floor_divide(frame, int64(2)), int64(1))
        bins = half if attr.get("onesided", 1) else frame
        fits = relax.op.logical_and(relax.op.greater_equal(frame, int64(1)),
                                    relax.op.less_equal(frame, int64(n)))
        ok = relax.op.logical_and(relax.op.logical_and(relax.op.greater_equal(s, int64(1)), same), fits)
        values = relax.op.concat([relax.op.reshape(v, [1]) for v in (s, frame, frames, bins)], axis=0)
        dims = symbolic_dims(bb, values, 4, "stft", bb.normalize(ok))
        return bb.emit_te(_stft, signal, window, *dims)

