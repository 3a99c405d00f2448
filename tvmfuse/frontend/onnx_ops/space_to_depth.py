"""ONNX ``SpaceToDepth`` with ``mode`` (DCR, the default, or CRD; 0.27 ignores the attribute)::

    t = X.reshape(N, C, H/b, b, W/b, b)
    Y = t.transpose(0, 3, 5, 1, 2, 4)  (DCR)  |  t.transpose(0, 1, 3, 5, 2, 4)  (CRD)
    Y = Y.reshape(N, C·b·b, H/b, W/b)
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._common import refuse

_ORDER = {"DCR": [0, 3, 5, 1, 2, 4], "CRD": [0, 1, 3, 5, 2, 4]}


class SpaceToDepth(stock.SpaceToDepth):
    """``SpaceToDepth`` in either ordering."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        mode = attr.get("mode", "DCR")
        mode = mode.decode() if isinstance(mode, bytes) else str(mode)
        if mode not in _ORDER:
            raise refuse(attr, "SpaceToDepth", f"attribute mode={mode!r}")
        size = int(attr["blocksize"])
        b, c, h, w = inputs[0].ty.shape
        x = relax.op.reshape(inputs[0], (b, c, h // size, size, w // size, size))
        x = relax.op.permute_dims(x, _ORDER[mode])
        return relax.op.reshape(x, (b, c * size * size, h // size, w // size))
