"""ONNX ``Constant`` given by ``value_int`` / ``value_ints`` / ``value_float`` / ``value_floats``.

TVM 0.27's converter reads only ``value`` (a tensor) and fails with "no value in Constant"
otherwise. The node loop folds top-level constants itself; subgraphs (an ``If`` branch) reach
the converter::

    value_int → int64 scalar        value_ints → int64 (n,)
    value_float → float32 scalar    value_floats → float32 (n,)
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

_SCALARS = {"value_int": "int64", "value_ints": "int64", "value_float": "float32", "value_floats": "float32"}


class Constant(stock.Constant):
    """TVM's ``Constant`` that also takes the scalar / list attributes."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        for name, dtype in _SCALARS.items():
            if name in attr and "value" not in attr:
                return relax.const(np.asarray(attr[name], dtype=dtype), dtype)
        return super()._impl_v13(bb, inputs, attr, params)
