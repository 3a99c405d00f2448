"""ONNX ``Trilu`` (opset 14) of a tensor with a zero-length dim: the (empty) input itself. 0.27's
runtime-``k`` path fails to type its mask there; every other case is TVM's converter."""

from __future__ import annotations

from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape


class Trilu(stock.Trilu):
    """``Trilu``; an empty input is returned unchanged (it has no element to zero)."""

    @classmethod
    def _impl_v14(cls, bb, inputs, attr, params):
        shape = static_shape(inputs[0])
        if shape is not None and 0 in shape:
            return inputs[0]
        return super()._impl_v14(bb, inputs, attr, params)
