"""ONNX ``CumSum`` with the ``axis`` input a runtime scalar.

``axis`` takes one of ``r`` values (``[-r, r)``), and the output shape is the input's whatever it
is, so every candidate is computed by TVM's converter (a constant axis each) and the one asked
for is selected at run time::

    out = where(a == 0, cumsum_0(x), where(a == 1, cumsum_1(x), … cumsum_{r-1}(x)))
    a   = axis mod r                            (axis outside [-r, r): the call fails)

``r`` scans instead of one: correct at any axis, cheap for the small tensors this form meets.
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from .runtime_values import Fallback, checked, int64, normalized_axes, scalar


def cumsum_runtime_axis(bb: relax.BlockBuilder, inputs: list, attr: dict, fallback: Fallback) -> relax.Expr:
    """``CumSum(x, axis)`` with ``axis`` a runtime tensor (see the module docstring)."""
    data, axis = inputs[0], inputs[1]
    rank = data.ty.ndim
    if rank < 1:
        raise ValueError(f"CumSum: a runtime axis needs data of known rank >= 1, got {data.ty}")
    a = bb.normalize(normalized_axes(scalar(bb, axis), rank))
    out = None
    for k in reversed(range(rank)):
        candidate = bb.normalize(fallback([data, relax.const(np.int64(k), "int64")]))
        out = candidate if out is None else relax.op.where(relax.op.equal(a, int64(k)), candidate, out)
    ok = relax.op.logical_and(relax.op.greater_equal(a, int64(0)), relax.op.less(a, int64(rank)))
    return checked(bb, out, bb.normalize(ok))
