"""ONNX ``TopK`` with the ``K`` input a runtime tensor.

All ``n`` entries of ``axis`` are ranked by TVM's ``topk`` (``k = n``, sorted, ties in index
order), and the first ``K`` (a symbolic dim ``topk_0`` bound at run time) are kept: one window
kernel per output. ``K`` outside ``[0, n]`` fails the call.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, tirx

from ...relax_shapes import static_shape
from .runtime_values import Fallback, axis_window, int64, scalar, symbolic_dims

_UNSORTABLE = ("uint64", "uint32", "bool")  # TVM's CPU sort: "Unsupported input dtype"


def topk_runtime_k(bb: relax.BlockBuilder, inputs: list, attr: dict, fallback: Fallback) -> relax.Expr:
    """``TopK(x, K)`` with ``K`` a runtime tensor (see the module docstring)."""
    data, k = inputs[0], inputs[1]
    shape = static_shape(data)
    if not shape:
        raise ValueError(f"TopK: a runtime K needs data of static shape and rank >= 1, got {data.ty}")
    axis = attr.get("axis", -1) % len(shape)
    if attr.get("sorted", 1) != 1:
        raise ValueError("TopK: sorted=0 is not supported")
    if str(data.ty.dtype) in _UNSORTABLE:
        raise ValueError(f"TopK: TVM's sort does not take {data.ty.dtype} data")
    ranked = bb.normalize(fallback([data, relax.const(np.array([shape[axis]], "int64"), "int64")]))
    kk = scalar(bb, k)
    ok = relax.op.logical_and(relax.op.greater_equal(kk, int64(0)),
                              relax.op.less_equal(kk, int64(shape[axis])))
    (count,) = symbolic_dims(bb, kk, 1, "topk", bb.normalize(ok))
    zero = tirx.IntImm("int64", 0)
    return relax.Tuple([axis_window(bb, bb.normalize(relax.TupleGetItem(ranked, i)), axis, zero, count)
                        for i in range(2)])
