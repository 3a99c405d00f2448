"""ONNX ``Col2Im`` (opset 18): sliding blocks (N, C·∏K, L) summed back into images (N, C, *I).

``image_shape`` I and ``block_shape`` K (D values each) may be runtime tensors: they become
symbolic dims bound at run time, with the checks the op requires (every ``K_d ≥ 1``, ``B_d ≥ 1``,
``C·∏K`` the input's channels, ``∏B = L``; a violation fails the call)::

    B_d = (I_d + pad_begin_d + pad_end_d − dil_d·(K_d − 1) − 1) // stride_d + 1     blocks per axis
    Y[n, c, y] = Σ_{k < K} X[n, c·∏K + flat_K(k), flat_B(o)]
                 where y_d + pad_begin_d − k_d·dil_d = o_d·stride_d,  0 ≤ o_d < B_d

One TE kernel (a reduction over the block offsets k) with the symbolic output shape.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape
from ._common import refuse
from .runtime_values import all_of, as_int64, int64, symbolic_dims


def _flat(index: list, extents: list) -> tirx.PrimExpr:
    """Row-major flat index of ``index`` in a grid of ``extents``."""
    out = index[0]
    for i, e in zip(index[1:], extents[1:], strict=True):
        out = out * e + i
    return out


def _product(values: list) -> tirx.PrimExpr:
    out = values[0]
    for v in values[1:]:
        out = out * v
    return out


class Col2Im(stock.OnnxOpConverter):
    """``Col2Im`` with static input shape; image / block shapes constant or runtime."""

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        x, image, block = inputs[0], inputs[1], inputs[2]
        shape = static_shape(x)
        lengths = [static_shape(v) for v in (image, block)]
        if shape is None or len(shape) != 3 or None in lengths or lengths[0] != lengths[1] \
                or len(lengths[0]) != 1:
            raise refuse(attr, "Col2Im", f"input {x.ty} / image_shape / block_shape of dynamic shape")
        rank = lengths[0][0]
        strides = list(attr.get("strides", [1] * rank))
        dilations = list(attr.get("dilations", [1] * rank))
        pads = list(attr.get("pads", [0] * 2 * rank))
        _, channels, length = shape
        img, blk = (bb.normalize(as_int64(bb.normalize(v))) for v in (image, block))
        def vec(values: list[int]) -> relax.Expr:
            return relax.const(np.array(values, "int64"), "int64")

        spread = relax.op.multiply(vec(dilations), relax.op.subtract(blk, int64(1)))
        padded = relax.op.add(img, vec([pads[d] + pads[d + rank] - 1 for d in range(rank)]))
        blocks = relax.op.add(relax.op.floor_divide(relax.op.subtract(padded, spread), vec(strides)),
                              int64(1))
        per_channel = relax.op.prod(blk)
        ok = relax.op.logical_and(
            relax.op.logical_and(all_of(relax.op.greater_equal(blk, int64(1))),
                                 all_of(relax.op.greater_equal(blocks, int64(1)))),
            relax.op.logical_and(relax.op.equal(relax.op.prod(blocks), int64(length)),
                                 relax.op.equal(relax.op.floor_mod(int64(channels), per_channel), int64(0))))
        out_c = relax.op.reshape(relax.op.floor_divide(int64(channels), per_channel), [1])
        dims = symbolic_dims(bb, relax.op.concat([img, blk, out_c], axis=0), 2 * rank + 1, "col2im",
                             bb.normalize(ok))

        def col2im(data: te.Tensor, *syms: tirx.PrimExpr) -> te.Tensor:
            image_d, kernel_d = list(syms[:rank]), list(syms[rank:2 * rank])
            n_blocks = [(image_d[d] + pads[d] + pads[d + rank] - dilations[d] * (kernel_d[d] - 1) - 1)
                        // strides[d] + 1 for d in range(rank)]
            ks = [te.reduce_axis((0, kernel_d[d]), f"k{d}") for d in range(rank)]

            def value(b, c, *y):
                num = [y[d] + pads[d] - ks[d] * dilations[d] for d in range(rank)]
                origin = [tirx.floordiv(num[d], strides[d]) for d in range(rank)]
                valid = tirx.all(*[tirx.all(num[d] >= 0, tirx.floormod(num[d], strides[d]) == 0,
                                            origin[d] < n_blocks[d]) for d in range(rank)])
                clamped = [tirx.max(tirx.min(o, nb - 1), 0) for o, nb in zip(origin, n_blocks, strict=True)]
                load = data[b, c * _product(kernel_d) + _flat(ks, kernel_d), _flat(clamped, n_blocks)]
                return te.sum(tirx.Select(valid, load, tirx.const(0, data.dtype)), axis=ks)

            return te.compute([data.shape[0], syms[-1], *image_d], value, name="col2im")

        return bb.emit_te(col2im, x, *dims)
