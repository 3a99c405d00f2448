"""ONNX ``DeformConv`` (opset 19+), 2-D: a convolution whose taps are shifted per output pixel.

X (N, C, H, W), W (M, C/group, kh, kw), offset (N, og·2·kh·kw, oH, oW), mask (N, og·kh·kw, oH,
oW) (default 1), B (M) (default 0); tap (i, j) of output pixel (y, x) for input channel c
(offset group g = c // (C/og)) reads X at::

    p = (y·sh − pad_top + i·dh + offset[n, g, i, j, 0, y, x],
         x·sw − pad_left + j·dw + offset[n, g, i, j, 1, y, x])
    v[n, c, i, j, y, x] = mask[n, g, i, j, y, x] · bilinear(X[n, c], p)    (corners outside: 0)
    Y[n, m, y, x] = B[m] + Σ_{c', i, j} W[m, c', i, j] · v[n, (m // (M/group))·(C/group) + c', i, j, y, x]

(the reference's GridSample with align_corners=1, zero padding). Two TE kernels: the sampled
taps, then the grouped reduction.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape
from ._common import refuse


def _taps(x: te.Tensor, offset: te.Tensor, mask: te.Tensor | None, kernel: list[int],
          strides: list[int], pads: list[int], dilations: list[int], groups: int) -> te.Tensor:
    """``v`` of the module docstring: (N, C, kh, kw, oH, oW)."""
    n, c, height, width = (int(d) for d in x.shape)
    out_h, out_w = (int(d) for d in offset.shape[2:])
    per_group = c // groups
    dtype = x.dtype

    def pixel(b, ch, h, w):
        inside = tirx.all(h >= 0, h < height, w >= 0, w < width)
        value = x[b, ch, tirx.max(tirx.min(h, height - 1), 0), tirx.max(tirx.min(w, width - 1), 0)]
        return tirx.Select(inside, value, tirx.const(0, dtype))

    def tap(b, ch, i, j, y, xo):
        g = ch // per_group
        k = g * kernel[0] * kernel[1] + i * kernel[1] + j
        ph = (y * strides[0] - pads[0] + i * dilations[0]).astype(dtype) + offset[b, k * 2, y, xo]
        pw = (xo * strides[1] - pads[1] + j * dilations[1]).astype(dtype) + offset[b, k * 2 + 1, y, xo]
        h0, w0 = tirx.floor(ph), tirx.floor(pw)
        lh, lw = ph - h0, pw - w0
        hi, wi = h0.astype("int32"), w0.astype("int32")
        one = tirx.const(1, dtype)
        value = ((one - lh) * ((one - lw) * pixel(b, ch, hi, wi) + lw * pixel(b, ch, hi, wi + 1))
                 + lh * ((one - lw) * pixel(b, ch, hi + 1, wi) + lw * pixel(b, ch, hi + 1, wi + 1)))
        return value if mask is None else value * mask[b, k, y, xo]

    return te.compute((n, c, kernel[0], kernel[1], out_h, out_w), tap, name="deform_taps")


def _reduce(taps: te.Tensor, weight: te.Tensor, bias: te.Tensor | None, group: int) -> te.Tensor:
    """``Y`` of the module docstring from the taps: (N, M, oH, oW)."""
    n, c, kh, kw, out_h, out_w = (int(d) for d in taps.shape)
    m, per_group = int(weight.shape[0]), int(weight.shape[1])
    out_per_group = m // group
    rc, ri, rj = (te.reduce_axis((0, e), name) for e, name in ((per_group, "c"), (kh, "i"), (kw, "j")))

    def out(b, o, y, x):
        channel = (o // out_per_group) * per_group + rc
        return te.sum(weight[o, rc, ri, rj] * taps[b, channel, ri, rj, y, x], axis=[rc, ri, rj])

    summed = te.compute((n, m, out_h, out_w), out, name="deform_sum")
    if bias is None:
        return summed
    return te.compute(summed.shape, lambda b, o, y, x: summed[b, o, y, x] + bias[o], name="deform_bias")


class DeformConv(stock.OnnxOpConverter):
    """2-D ``DeformConv`` with static shapes."""

    @classmethod
    def _impl_v19(cls, bb, inputs, attr, params):
        inputs = list(inputs) + [None] * (5 - len(inputs))
        x, w, offset, bias, mask = inputs[:5]
        shapes = [static_shape(v) for v in (x, w, offset)]
        if None in shapes or len(shapes[0]) != 4 or min(shapes[0][2:]) < 2:
            raise refuse(attr, "DeformConv", f"input {x.ty} (2-D, static shapes, H, W ≥ 2)")
        kernel = list(attr.get("kernel_shape", shapes[1][2:]))
        group, groups = attr.get("group", 1), attr.get("offset_group", 1)
        if shapes[0][1] % groups or shapes[0][1] != shapes[1][1] * group or shapes[1][0] % group:
            raise refuse(attr, "DeformConv", f"channels {shapes[0][1]} / weight {shapes[1]} with group "
                         f"{group}, offset_group {groups}")
        taps = bb.emit_te(_taps, x, offset, mask, kernel, list(attr.get("strides", [1, 1])),
                          list(attr.get("pads", [0, 0, 0, 0]))[:2], list(attr.get("dilations", [1, 1])),
                          groups)
        return bb.emit_te(_reduce, taps, w, bias, group)

