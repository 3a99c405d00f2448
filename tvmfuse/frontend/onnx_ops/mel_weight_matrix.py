"""ONNX ``MelWeightMatrix`` (opset 17) with runtime scalar inputs (its output shape follows them).

As the ONNX reference computes it (M = num_mel_bins, D = dft_length, r = sample_rate)::

    mel(f)  = 2595·log1p(f / 700) / ln 10       (f / 700, log1p and the product in float32)
    step    = (mel(upper) − mel(lower)) / (M + 2)
    bin[k]  = floor((D + 1)·700·(exp((k·step + mel(lower))·ln 10 / 2595) − 1) / r),  k ≤ M + 1
    W[j, i] = (j − l) / (c − l) for l ≤ j ≤ c (1 at j = c when c = l),
              (h − j) / (h − c) for c ≤ j < h,  else 0      (l, c, h = bin[i], bin[i+1], bin[i+2])

W (D // 2 + 1, M) of ``output_datatype``; the dims are symbolic, bound at run time. The call
fails unless M ≥ 0, D ≥ 0, r > 0, upper ≥ lower and 0 ≤ bin[k] ≤ D // 2 (the reference wraps
negative rows around, an index error past the end). Two TE kernels: the bins, the matrix.
"""

from __future__ import annotations

import math

from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock

from .runtime_values import checked, int64, scalar, symbolic_dims

_F64 = "float64"


def _bins(lower: te.Tensor, upper: te.Tensor, dft: te.Tensor, rate: te.Tensor,
          count: tirx.PrimExpr) -> te.Tensor:
    """bin[k], k < M + 2 = ``count`` (int64)."""
    ln10 = tirx.const(math.log(10), _F64)

    def mel(hertz):
        f32 = hertz.astype("float32")
        scaled = tirx.log1p(f32 / tirx.const(700, "float32")) * tirx.const(2595, "float32")
        return scaled.astype(_F64) / ln10

    def value(k):
        low, high = mel(lower[()]), mel(upper[()])
        step = (high - low) / count.astype(_F64)
        exponent = (k.astype(_F64) * step + low) / tirx.const(2595, _F64) * ln10
        hertz = tirx.const(700, _F64) * (tirx.exp(exponent) - tirx.const(1, _F64))
        spread = (dft[()].astype(_F64) + tirx.const(1, _F64)) * hertz
        return tirx.floor(spread / rate[()].astype(_F64)).astype("int64")

    return te.compute((count,), value, name="mel_bins")


def _matrix(bins: te.Tensor, rows: tirx.PrimExpr, mels: tirx.PrimExpr, dtype: str) -> te.Tensor:
    """W (rows, mels) from the bins."""

    def value(j, i):
        low, centre, high = bins[i], bins[i + 1], bins[i + 2]
        jj = j.astype("int64")
        one, zero = tirx.const(1, _F64), tirx.const(0, _F64)
        up = tirx.Select(tirx.all(jj >= low, jj <= centre),
                         (jj - low).astype(_F64) / (centre - low).astype(_F64), zero)
        rising = tirx.Select(centre == low, tirx.Select(jj == centre, one, zero), up)
        falling = (high - jj).astype(_F64) / (high - centre).astype(_F64)
        w = tirx.Select(tirx.all(high > centre, jj >= centre, jj < high), falling, rising)
        return w.astype(dtype)

    return te.compute((rows, mels), value, name="mel_weight_matrix")


class MelWeightMatrix(stock.OnnxOpConverter):
    """``MelWeightMatrix`` (see the module docstring)."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        mels, dft, rate = (scalar(bb, v) for v in inputs[:3])
        lower, upper = (bb.normalize(relax.op.reshape(v, [])) for v in inputs[3:5])
        dtype = stock.get_type(attr.get("output_datatype", 1))
        rows = relax.op.add(relax.op.floor_divide(dft, int64(2)), int64(1))
        sizes = relax.op.logical_and(relax.op.greater_equal(mels, int64(0)),
                                     relax.op.greater_equal(dft, int64(0)))
        ok = relax.op.logical_and(sizes, relax.op.logical_and(relax.op.greater(rate, int64(0)),
                                                              relax.op.greater_equal(upper, lower)))
        values = relax.op.concat([relax.op.reshape(v, [1]) for v in (rows, mels)], axis=0)
        n_rows, n_mels = symbolic_dims(bb, values, 2, "mel", bb.normalize(ok))
        bins = bb.emit_te(_bins, lower, upper, inputs[1], inputs[2], n_mels + 2)
        inside = relax.op.logical_and(relax.op.greater_equal(relax.op.min(bins), int64(0)),
                                      relax.op.less(relax.op.max(bins), rows))
        bins = checked(bb, bins, bb.normalize(inside))
        return bb.emit_te(_matrix, bins, n_rows, n_mels, dtype)
