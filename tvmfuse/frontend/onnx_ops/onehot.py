"""ONNX ``OneHot`` with the ``depth`` input a runtime tensor.

``depth`` (any numeric type, cast to int64) becomes the symbolic dim ``depth_0`` at run time,
inserted into the indices' shape at ``axis``; one TE kernel writes::

    out[…, j, …] = values[1] if (idx < 0 ? idx + depth : idx) == j else values[0]

(indices outside ``[-depth, depth)`` give a row of ``values[0]``, as ONNX says). ``depth < 1``
fails the call.
"""

from __future__ import annotations

from tvm import relax, te, tirx

from .runtime_values import Fallback, int64, scalar, symbolic_dims


def onehot_runtime_depth(bb: relax.BlockBuilder, inputs: list, attr: dict, fallback: Fallback) -> relax.Expr:
    """``OneHot(indices, depth, values)`` with ``depth`` a runtime tensor (module docstring)."""
    indices, depth, values = inputs[:3]
    rank = indices.ty.ndim
    if rank < 0:
        raise ValueError(f"OneHot: a runtime depth needs indices of known rank, got {indices.ty}")
    axis = attr.get("axis", -1) % (rank + 1)
    d = scalar(bb, depth)
    (size,) = symbolic_dims(bb, d, 1, "depth", bb.normalize(relax.op.greater_equal(d, int64(1))))

    def onehot(ind: te.Tensor, val: te.Tensor) -> te.Tensor:
        shape = [*ind.shape[:axis], size, *ind.shape[axis:]]

        def body(*i):
            raw = tirx.Cast("int64", ind(*i[:axis], *i[axis + 1:]))
            where = tirx.Select(raw < 0, raw + size, raw)
            return tirx.Select(where == i[axis], val[1], val[0])

        return te.compute(shape, body, name="one_hot")

    return bb.emit_te(onehot, indices, values)
