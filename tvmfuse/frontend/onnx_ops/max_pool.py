"""ONNX ``MaxPool`` with its second output ``Indices`` (0.27 returns only the values).

``Y`` comes from TVM's converter; for each output position the index of the first maximum in
row-major scan order of its window (padding excluded), flattened over the whole input::

    p     = min{ flat(q) : q in window(o) inside the input, X[n, c, q] == Y[n, c, o] }
    I     = (n·C + c)·∏S + p                     (storage_order 0: row-major)
          = (n·C + c)·∏S + h + w·H               (storage_order 1, 2-D: column-major)

One TE kernel (a min-reduction over the window). Explicit pads only (``auto_pad`` NOTSET).
"""

from __future__ import annotations

from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape
from ._common import refuse


def _indices(x: te.Tensor, y: te.Tensor, kernel: list[int], strides: list[int], pads: list[int],
             dilations: list[int], column_major: bool) -> te.Tensor:
    """int64 flat input index of each ``y`` element's first maximum (module docstring)."""
    spatial = [int(d) for d in x.shape[2:]]
    rank = len(spatial)
    ks = [te.reduce_axis((0, k), f"k{d}") for d, k in enumerate(kernel)]
    size = 1
    for s in spatial:
        size *= s

    def first(n, c, *o):
        pos = [o[d] * strides[d] - pads[d] + ks[d] * dilations[d] for d in range(rank)]
        inside = tirx.all(*[tirx.all(p >= 0, p < s) for p, s in zip(pos, spatial, strict=True)])
        clamped = [tirx.max(tirx.min(p, s - 1), 0) for p, s in zip(pos, spatial, strict=True)]
        flat = clamped[0]
        for p, s in zip(clamped[1:], spatial[1:], strict=True):
            flat = flat * s + p
        hit = tirx.all(inside, x[(n, c, *clamped)] == y[(n, c, *o)])
        return te.min(tirx.Select(hit, flat.astype("int64"), tirx.const(size, "int64")), axis=ks)

    best = te.compute(y.shape, first, name="first_max")

    def index(n, c, *o):
        p = best[(n, c, *o)]
        if column_major:
            p = tirx.floormod(p, spatial[1]) * spatial[0] + tirx.floordiv(p, spatial[1])
        return (n.astype("int64") * int(x.shape[1]) + c.astype("int64")) * size + p

    return te.compute(y.shape, index, name="max_index")


class MaxPool(stock.MaxPool):
    """``MaxPool``; with two outputs, the indices as well."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if attr.get("tvm_custom", {}).get("num_outputs", 1) < 2:
            return super()._impl_v1(bb, inputs, attr, params)
        auto_pad = attr.get("auto_pad", b"NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
        x = inputs[0]
        shape = static_shape(x)
        order = attr.get("storage_order", 0)
        if auto_pad != "NOTSET" or shape is None or (order and len(shape) != 4):
            raise refuse(attr, "MaxPool", f"output Indices with auto_pad={auto_pad} / storage_order="
                         f"{order} / input {x.ty} (explicit pads, a static shape)")
        kernel = list(attr["kernel_shape"])
        rank = len(kernel)
        values = bb.normalize(super()._impl_v1(bb, inputs, dict(attr), params))
        index = bb.emit_te(_indices, x, values, kernel, list(attr.get("strides", [1] * rank)),
                           list(attr.get("pads", [0] * 2 * rank))[:rank],
                           list(attr.get("dilations", [1] * rank)), bool(order))
        return relax.Tuple([values, index])
