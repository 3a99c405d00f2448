"""ONNX window functions (opset 17), ``size`` a scalar (constant or runtime), in float64 then
cast to ``output_datatype`` (default float)::

    D = size if periodic else size − 1,   θ_n = 2πn / D,   n = 0 … size − 1
    HannWindow:      0.5 − 0.5·cos θ_n
    HammingWindow:   25/46 − 21/46·cos θ_n
    BlackmanWindow:  0.42 − 0.5·cos θ_n + 0.08·cos 2θ_n

A runtime ``size`` gives the output a symbolic length (``_common.scalar_dim``).
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._common import scalar_dim

_F64 = "float64"


def _window(bb, inputs, attr, coeffs: tuple[float, ...]) -> relax.Expr:
    """Σ_k (−1)^k·coeffs[k]·cos(k·θ_n) over a window of ``inputs[0]`` samples."""
    size = inputs[0]
    n = scalar_dim(bb, size, "window_len")
    denom = relax.op.astype(relax.op.reshape(size, []), _F64)
    if not attr.get("periodic", 1):
        denom = relax.op.subtract(denom, relax.const(1.0, _F64))
    theta = bb.normalize(relax.op.divide(
        relax.op.multiply(relax.op.arange(0, n, 1, _F64), relax.const(2 * math.pi, _F64)), denom))
    y = relax.const(coeffs[0], _F64)
    for k, c in enumerate(coeffs[1:], start=1):
        term = relax.op.multiply(relax.const((-1) ** k * c, _F64),
                                 relax.op.cos(relax.op.multiply(theta, relax.const(float(k), _F64))))
        y = relax.op.add(y, term)
    return relax.op.astype(y, stock.get_type(attr.get("output_datatype", 1)))


class HannWindow(stock.OnnxOpConverter):
    """``0.5 − 0.5·cos θ``."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        return _window(bb, inputs, attr, (0.5, 0.5))


class HammingWindow(stock.OnnxOpConverter):
    """``25/46 − 21/46·cos θ``."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        return _window(bb, inputs, attr, (25 / 46, 21 / 46))


class BlackmanWindow(stock.OnnxOpConverter):
    """``0.42 − 0.5·cos θ + 0.08·cos 2θ``."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        return _window(bb, inputs, attr, (0.42, 0.5, 0.08))
