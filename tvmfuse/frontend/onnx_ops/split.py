"""ONNX ``Split`` with the ``split`` input a runtime tensor (its static length = the outputs).

The sizes become symbolic dims ``split_i`` at run time; output ``i`` is the window
``[Σ_{j<i} split_j, Σ_{j≤i} split_j)`` of ``axis`` (one TE kernel each). Sizes that are negative
or do not add up to the axis length fail the call.
"""

from __future__ import annotations

from tvm import relax

from .runtime_values import Fallback, all_of, axis_window, int64, prim_sum, static_length, symbolic_dims


def split_runtime_sizes(bb: relax.BlockBuilder, inputs: list, attr: dict, fallback: Fallback) -> relax.Expr:
    """``Split(x, split)`` with ``split`` a runtime tensor (see the module docstring)."""
    data, sizes = inputs[0], inputs[1]
    count = static_length(sizes)
    rank = data.ty.ndim
    if count is None or sizes.ty.ndim != 1 or rank < 1:
        raise ValueError(f"Split: a runtime split needs a 1-D split of static length and data of "
                         f"known rank (split {sizes.ty}, data {data.ty})")
    axis = attr.get("axis", 0) % rank
    length = relax.op.take(relax.op.shape_to_tensor(relax.op.shape_of(data)), int64(axis), axis=0)
    as64 = bb.normalize(relax.op.astype(sizes, "int64"))
    ok = relax.op.logical_and(
        relax.op.equal(relax.op.sum(as64), length),
        all_of(relax.op.greater_equal(as64, int64(0))))
    dims = symbolic_dims(bb, as64, count, "split", bb.normalize(ok))
    parts = [axis_window(bb, data, axis, prim_sum(dims[:i]), dims[i]) for i in range(count)]
    return relax.Tuple(parts)
