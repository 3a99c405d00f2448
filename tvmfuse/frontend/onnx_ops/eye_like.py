"""ONNX ``EyeLike`` (opset 9+) with a ``dtype`` attribute other than the input's (0.27 refuses
it, and its ``R.eye_like`` legalizes to the input's dtype whatever ``dtype`` says)::

    Y[i, j] = (j − i == k)          of ``dtype`` (default: the input's), X's 2-D shape
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._common import dtype_of


class EyeLike(stock.EyeLike):
    """``EyeLike`` of any ``dtype``."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        dtype = stock.get_type(attr["dtype"]) if "dtype" in attr else dtype_of(inputs[0])
        eye = relax.op.eye_like(inputs[0], attr.get("k", 0), dtype_of(inputs[0]))
        return eye if dtype == dtype_of(inputs[0]) else relax.op.astype(eye, dtype)
