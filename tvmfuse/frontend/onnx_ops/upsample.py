"""ONNX ``Upsample`` (opsets 7–9; deprecated for ``Resize``) as a ``Resize`` with
``coordinate_transformation_mode=asymmetric`` and ``nearest_mode=floor`` (onnxruntime's legacy
Upsample)::

    out dims = floor(dims · scales);  nearest: in[floor(o / s)];  linear: asymmetric bilinear

``scales`` (an attribute to opset 8, an input from 9, constant or runtime) goes through
:func:`.resize.resize_runtime` (output dims bound at run time). 0.27's converter reads the
attribute only and fails on the input.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._common import refuse
from .resize import resize_runtime


def _no_fallback(_: list) -> relax.Expr:
    raise ValueError("Upsample: no constant-scales form")


class Upsample(stock.Upsample):
    """``Upsample`` with nearest or linear mode."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        scales = relax.const(np.array(attr["scales"], "float32"), "float32")
        return cls._resize(bb, inputs[0], scales, attr)

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        return cls._resize(bb, inputs[0], inputs[1], attr)

    @classmethod
    def _resize(cls, bb, x, scales, attr):
        mode = attr.get("mode", b"nearest")
        mode = mode.decode() if isinstance(mode, bytes) else str(mode)
        if mode not in ("nearest", "linear"):
            raise refuse(attr, "Upsample", f"attribute mode={mode!r}")
        resize = {"mode": mode, "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
        try:
            return resize_runtime(bb, [x, None, scales], resize, _no_fallback)
        except ValueError as err:
            raise refuse(attr, "Upsample", str(err)) from err
