"""ONNX ``DFT`` (opsets 17–20) as matmuls with constant cos / sin matrices, in the input dtype.

X (…, N along ``axis``, …, 1 | 2) (real | complex), L = ``dft_length`` (default N; 2·(N − 1) for
an inverse one-sided input), θ_nk = 2π·n·k / L, the signal truncated or zero-padded to L::

    forward:   Y_k = Σ_n X_n·e^(−iθ_nk)               k < L, or k ≤ L/2 with onesided=1
    inverse:   Y_n = (1/L)·Σ_k X_k·e^(+iθ_nk)
    inverse, onesided (irfft): the input holds bins k ≤ L/2 of a Hermitian spectrum, the output is
               real (…, L, …, 1):  Y_n = (1/L)·Σ_k w_k·(Re X_k·cos θ_nk − Im X_k·sin θ_nk),
               w_k = 1 for k = 0 and k = L/2, else 2

``axis`` (attribute to opset 19, input from 20: a runtime one goes through
:mod:`.runtime_axis`) and ``dft_length`` must be constants (:mod:`.static_inputs` refuses a
runtime ``dft_length``).
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape
from ._common import constant, dtype_of, refuse


def _matrices(n_in: int, length: int, inverse: bool, onesided: bool) -> tuple[np.ndarray, np.ndarray]:
    """(C, S) with Y_re = X_re·C − X_im·S, Y_im = X_re·S + X_im·C; rows: the input's n_in samples."""
    if inverse and onesided:
        bins = np.arange(min(n_in, length // 2 + 1))
        theta = 2 * np.pi * np.outer(bins, np.arange(length)) / length
        w = np.where((bins == 0) | (2 * bins == length), 1.0, 2.0)[:, None] / length
        return w * np.cos(theta), w * np.sin(theta)
    out = length // 2 + 1 if onesided else length
    theta = 2 * np.pi * np.outer(np.arange(min(n_in, length)), np.arange(out)) / length
    if inverse:
        return np.cos(theta) / length, np.sin(theta) / length
    return np.cos(theta), -np.sin(theta)


class DFT(stock.OnnxOpConverter):
    """``DFT`` (see the module docstring)."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        return cls._convert(bb, inputs, attr, attr.get("axis", 1))

    @classmethod
    def _impl_v20(cls, bb, inputs, attr, params):
        axis = constant(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else np.array(-2)
        return cls._convert(bb, inputs, attr, int(axis.reshape(-1)[0]))

    @classmethod
    def _convert(cls, bb, inputs, attr, axis: int):
        x = inputs[0]
        shape = static_shape(x)
        if shape is None:
            raise refuse(attr, "DFT", "input with a dynamic shape")
        ndim, dtype = len(shape), dtype_of(x)
        axis %= ndim
        if axis == ndim - 1:
            raise refuse(attr, "DFT", f"attribute axis={axis} (the last axis holds re / im)")
        inverse, onesided = bool(attr.get("inverse", 0)), bool(attr.get("onesided", 0))
        if onesided and not inverse and shape[-1] == 2:
            raise refuse(attr, "DFT", "attribute onesided=1 with a complex input")
        n_in = shape[axis]
        length_in = inputs[1] if len(inputs) > 1 and inputs[1] is not None else None
        length = int(constant(length_in).reshape(-1)[0]) if length_in is not None else (
            2 * (n_in - 1) if inverse and onesided else n_in)
        if length < 1:
            raise refuse(attr, "DFT", f"a signal of length {length} along axis {axis}")
        c, s = _matrices(n_in, length, inverse, onesided)
        rows = c.shape[0]
        order = [i for i in range(ndim - 1) if i != axis] + [axis]
        back = list(np.argsort(order))

        def part(i: int) -> relax.Expr:
            v = relax.op.squeeze(relax.op.strided_slice(x, [ndim - 1], [i], [i + 1]), [ndim - 1])
            v = relax.op.permute_dims(v, order)
            return bb.normalize(relax.op.strided_slice(v, [ndim - 2], [0], [rows]))

        def mm(v: relax.Expr, m: np.ndarray) -> relax.Expr:
            return relax.op.matmul(v, relax.const(m.astype(dtype), dtype))

        re = part(0)
        im = part(1) if shape[-1] == 2 else None
        y_re = mm(re, c) if im is None else relax.op.subtract(mm(re, c), mm(im, s))
        outs = [y_re]
        if not (inverse and onesided):
            outs.append(mm(re, s) if im is None else relax.op.add(mm(re, s), mm(im, c)))
        outs = [relax.op.permute_dims(bb.normalize(v), back) for v in outs]
        return relax.op.stack(outs, axis=ndim - 1)
