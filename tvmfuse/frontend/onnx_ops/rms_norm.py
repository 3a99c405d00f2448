"""ONNX ``RMSNormalization`` (opset 23) over several trailing axes.

Over the axes ``[axis, rank)``, in ``stash_type`` (float32)::

    Y = X / sqrt(mean(X², axes) + epsilon) · Scale          Scale broadcast to X.shape[axis:]

A last-axis norm goes through TVM's converter (``astype(rms_norm(astype(X, f32), ·), T)``, the
form the norm passes match and fuse). Over ``k > 1`` axes TVM's ``rms_norm`` fails to legalise
when it reduces every axis; here X is viewed as (prod(X.shape[:axis]), N) with N the product of the
normalised dims, Scale broadcast to X.shape[axis:] and flattened to (N,), normalised over the last
axis by the same converter and reshaped back: the same numbers, one last-axis norm.
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import shape_expr, static_shape


class RMSNormalization(stock.RMSNormalization):
    """``RMSNormalization`` as one last-axis ``rms_norm`` (see the module docstring)."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        x, scale = inputs[0], inputs[1]
        shape = static_shape(x)
        ndim = x.ty.ndim
        axis = attr.get("axis", -1)
        if shape is None or not -ndim <= axis < ndim or axis % ndim == ndim - 1:
            return super()._impl_v23(bb, inputs, attr, params)
        axis %= ndim
        inner = shape[axis:]
        n = math.prod(inner)
        x2 = relax.op.reshape(x, shape_expr([math.prod(shape[:axis]), n]))
        if static_shape(scale) != inner:
            scale = relax.op.broadcast_to(scale, shape_expr(inner))
        w = relax.op.reshape(scale, shape_expr([n]))
        y = super()._impl_v23(bb, [bb.normalize(x2), bb.normalize(w)], {**attr, "axis": -1}, params)
        return relax.op.reshape(y, shape_expr(shape))
