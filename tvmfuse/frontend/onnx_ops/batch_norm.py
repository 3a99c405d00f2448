"""ONNX ``BatchNormalization`` (opset 14/15) with ``training_mode=1``: batch statistics over every
axis but the channel axis 1, as onnx's reference::

    μ = mean(X)    σ² = mean((X − μ)²)                  (population variance)
    Y = (X − μ) / √(σ² + ε) · scale + B
    running_mean = mean · momentum + μ · (1 − momentum)
    running_var  = var · momentum + σ² · (1 − momentum)

Outputs Y, running_mean, running_var. Inference mode is TVM's converter.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._common import dtype_of


class BatchNormalization(stock.BatchNormalization):
    """``BatchNormalization``; training mode computed here."""

    @classmethod
    def _impl_v15(cls, bb, inputs, attr, params):
        if not attr.get("training_mode", 0):
            return super()._impl_v15(bb, inputs, attr, params)
        x, scale, bias, mean, var = inputs[:5]
        dtype, ndim = dtype_of(x), x.ty.ndim
        axes = [0] + list(range(2, ndim))
        view = [-1] + [1] * (ndim - 2)
        mu = bb.normalize(relax.op.mean(x, axes, keepdims=True))
        centred = bb.normalize(relax.op.subtract(x, mu))
        var_b = bb.normalize(relax.op.mean(relax.op.multiply(centred, centred), axes, keepdims=True))
        eps = relax.const(attr.get("epsilon", 1e-5), dtype)
        y = relax.op.multiply(relax.op.divide(centred, relax.op.sqrt(relax.op.add(var_b, eps))),
                              relax.op.reshape(scale, view))
        y = relax.op.add(y, relax.op.reshape(bias, view))
        m = relax.const(attr.get("momentum", 0.9), dtype)
        rest = relax.const(1.0 - attr.get("momentum", 0.9), dtype)

        def running(old: relax.Expr, batch: relax.Expr) -> relax.Expr:
            return relax.op.add(relax.op.multiply(old, m),
                                relax.op.multiply(relax.op.reshape(batch, [-1]), rest))

        outs = (y, running(mean, mu), running(var, var_b))
        return relax.Tuple([bb.normalize(v) for v in outs])
