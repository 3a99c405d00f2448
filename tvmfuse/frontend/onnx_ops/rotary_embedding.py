"""ONNX ``RotaryEmbedding`` (opset 23) as elementwise Relax.

``input`` (B, H, S, D) or (B, S, H·D) with ``num_heads``; ``cos_cache`` / ``sin_cache``
(max_pos, R/2) gathered at ``position_ids`` (B, S), or already (B, S, R/2) without them; ``R =
rotary_embedding_dim`` (default D). The first R dims of each head rotate in pairs (x1, x2) — the two
halves of the R dims, or even / odd dims with ``interleaved`` — the rest pass through::

    x1' = cos · x1 − sin · x2          x2' = sin · x1 + cos · x2
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import shape_expr, static_shape


def _slice(x: relax.Expr, axis: int, begin: int, end: int, step: int = 1) -> relax.Expr:
    return relax.op.strided_slice(x, [axis], [begin], [end], [step])


class RotaryEmbedding(stock.OnnxOpConverter):
    """``RotaryEmbedding`` → gathers, slices, multiply-adds and a concat (module docstring)."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        x, cos, sin = inputs[:3]
        pos = inputs[3] if len(inputs) > 3 else None
        shape = static_shape(x)
        if shape is None or len(shape) not in (3, 4):
            raise ValueError(f"RotaryEmbedding: input must be 3-D or 4-D of static shape, got {x.ty}")
        if len(shape) == 3:
            heads = attr.get("num_heads", 0)
            if not heads or shape[2] % heads:
                raise ValueError(f"RotaryEmbedding: 3-D input {shape} needs num_heads dividing "
                                 f"{shape[2]}, got {heads}")
            xh = relax.op.reshape(x, shape_expr([*shape[:2], heads, shape[2] // heads]))  # (B, S, H, D)
            head_axis = 2
        else:
            xh, head_axis = x, 1  # (B, H, S, D)
        xh = bb.normalize(xh)
        d = static_shape(xh)[3]
        rot = attr.get("rotary_embedding_dim", 0) or d
        if rot % 2 or rot > d:
            raise ValueError(f"RotaryEmbedding: rotary_embedding_dim {rot} must be even and <= {d}")
        if pos is not None:
            cos, sin = (relax.op.take(c, pos, axis=0) for c in (cos, sin))  # (B, S, R/2)
        cos, sin = (bb.normalize(relax.op.expand_dims(c, head_axis)) for c in (cos, sin))
        if static_shape(cos)[-1] != rot // 2:
            raise ValueError(f"RotaryEmbedding: cos/sin caches have {static_shape(cos)[-1]} entries "
                             f"per position, rotary_embedding_dim / 2 is {rot // 2}")
        half = rot // 2
        if attr.get("interleaved", 0):
            x1, x2 = _slice(xh, 3, 0, rot, 2), _slice(xh, 3, 1, rot, 2)
        else:
            x1, x2 = _slice(xh, 3, 0, half), _slice(xh, 3, half, rot)
        x1, x2 = bb.normalize(x1), bb.normalize(x2)
        real = relax.op.subtract(relax.op.multiply(cos, x1), relax.op.multiply(sin, x2))
        imag = relax.op.add(relax.op.multiply(sin, x1), relax.op.multiply(cos, x2))
        if attr.get("interleaved", 0):
            pairs = relax.op.stack([real, imag], axis=4)  # (…, R/2, 2): real, imag alternate
            rotated = relax.op.reshape(pairs, shape_expr([*static_shape(x1)[:3], rot]))
        else:
            rotated = relax.op.concat([real, imag], axis=3)
        parts = [rotated] + ([_slice(xh, 3, rot, d)] if rot < d else [])
        out = relax.op.concat(parts, axis=3) if len(parts) > 1 else rotated
        return relax.op.reshape(out, shape_expr(shape)) if len(shape) == 3 else out
