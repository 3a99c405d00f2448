"""ONNX ``TensorScatter`` (opset 24): a KV-cache write as a gather (no scatter kernel).

``past_cache`` (B, …, L, …) with L on ``axis`` (default −2), ``update`` the same shape but S ≤ L
on ``axis``, ``write_indices`` (B,) (default 0). For cache position c of batch row b::

    u = c − write_indices[b]   (mod L when mode = "circular")
    present[…, c, …] = update[…, u, …]  if 0 ≤ u < S  else  past_cache[…, c, …]

``u`` is clamped into [0, S) for a ``gather_elements`` over ``update``, then selected by ``where``.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import shape_expr, static_shape


class TensorScatter(stock.OnnxOpConverter):
    """``TensorScatter`` → ``where(covered, gather_elements(update, u), past_cache)``."""

    @classmethod
    def _impl_v24(cls, bb, inputs, attr, params):
        past, update = inputs[0], inputs[1]
        widx = inputs[2] if len(inputs) > 2 else None
        shape, ushape = static_shape(past), static_shape(update)
        if shape is None or ushape is None:
            raise ValueError(f"TensorScatter: past_cache {past.ty} and update {update.ty} need static shapes")
        ndim = len(shape)
        axis = attr.get("axis", -2) % ndim
        mode = attr.get("mode", b"linear")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        if mode not in ("linear", "circular"):
            raise ValueError(f"TensorScatter: mode {mode!r} is not 'linear' or 'circular'")
        length, seq = shape[axis], ushape[axis]
        if axis == 0 or any(a != b for i, (a, b) in enumerate(zip(shape, ushape)) if i != axis) \
                or seq > length:
            raise ValueError(f"TensorScatter: update {ushape} does not fit past_cache {shape} on axis {axis}")
        at_axis = [1] * ndim
        at_axis[axis] = length
        c = relax.const(np.arange(length, dtype="int64").reshape(at_axis), "int64")
        if widx is None:
            u = c
        else:
            w = relax.op.astype(widx, "int64") if str(widx.ty.dtype) != "int64" else widx
            u = relax.op.subtract(c, relax.op.reshape(w, shape_expr([shape[0]] + [1] * (ndim - 1))))
        if mode == "circular":
            u = relax.op.floor_mod(u, relax.const(length, "int64"))
        u = bb.normalize(u)
        covered = bb.normalize(relax.op.logical_and(
            relax.op.greater_equal(u, relax.const(0, "int64")), relax.op.less(u, relax.const(seq, "int64"))))
        safe = relax.op.where(covered, u, relax.const(0, "int64"))
        index = bb.normalize(relax.op.broadcast_to(safe, shape_expr(shape)))
        return relax.op.where(covered, relax.op.gather_elements(update, index, axis), past)
