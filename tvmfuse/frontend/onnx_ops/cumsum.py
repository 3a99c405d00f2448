"""ONNX ``CumSum`` / ``CumProd`` with the ``axis`` input a runtime scalar.

``axis`` takes one of ``r`` values (``[-r, r)``), and the output shape is the input's whatever it
is, so every candidate is computed by the op's constant-axis converter and the one asked
for is selected at run time::

    out = where(a == 0, scan_0(x), where(a == 1, scan_1(x), … scan_{r-1}(x)))
    a   = axis mod r                            (axis outside [-r, r): the call fails)

``r`` scans instead of one: correct at any axis, cheap for the small tensors this form meets.
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from .runtime_values import Fallback, Handler, checked, int64, normalized_axes, scalar


def scan_runtime_axis(op: str) -> Handler:
    """The runtime-axis handler of the scan ``op`` (``CumSum`` / ``CumProd``: ``(x, axis)``)."""

    def convert(bb: relax.BlockBuilder, inputs: list, attr: dict, fallback: Fallback) -> relax.Expr:
        data, axis = inputs[0], inputs[1]
        rank = data.ty.ndim
        if rank < 1:
            raise ValueError(f"{op}: a runtime axis needs data of known rank >= 1, got {data.ty}")
        a = bb.normalize(normalized_axes(scalar(bb, axis), rank))
        out = None
        for k in reversed(range(rank)):
            candidate = bb.normalize(fallback([data, relax.const(np.int64(k), "int64")]))
            out = candidate if out is None else relax.op.where(relax.op.equal(a, int64(k)), candidate, out)
        ok = relax.op.logical_and(relax.op.greater_equal(a, int64(0)), relax.op.less(a, int64(rank)))
        return checked(bb, out, bb.normalize(ok))

    return convert


cumsum_runtime_axis = scan_runtime_axis("CumSum")
