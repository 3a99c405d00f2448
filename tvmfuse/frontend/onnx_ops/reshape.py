"""ONNX ``Reshape`` with the ``shape`` input a runtime tensor (of static length ``L``).

The target is resolved at run time as ONNX defines it, from the data's dims ``n`` (rank ``r``)::

    s[i] = n[i] if shape[i] == 0 and not allowzero (i < r) else shape[i]
    s[i] = numel / Π_{s[j] != -1} s[j]      where s[i] == -1 (at most one)

and becomes the output's symbolic dims ``reshape_0 … reshape_{L-1}``; a target whose element
count differs from the data's (or with two -1s, or other negatives) fails the call.
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from .runtime_values import Fallback, all_of, as_int64, dims_tensor, int64, static_length, symbolic_dims


def reshape_runtime_shape(bb: relax.BlockBuilder, inputs: list, attr: dict, fallback: Fallback) -> relax.Expr:
    """``Reshape(data, shape)`` with ``shape`` a runtime tensor (see the module docstring)."""
    data, shape = inputs[0], inputs[1]
    length = static_length(shape)
    rank = data.ty.ndim
    if length is None or shape.ty.ndim != 1 or rank < 0:
        raise ValueError(f"Reshape: a runtime shape needs a 1-D shape of static length and data of "
                         f"known rank (shape {shape.ty}, data {data.ty})")
    target = as_int64(shape)
    dims = dims_tensor(data)
    if length > rank:
        dims = relax.op.concat([dims, relax.const(np.zeros(length - rank, "int64"), "int64")], axis=0)
    elif length < rank:
        dims = relax.op.strided_slice(dims, axes=[0], begin=[0], end=[length])
    if not attr.get("allowzero", 0):
        target = relax.op.where(relax.op.equal(target, int64(0)), dims, target)
    target = bb.normalize(target)
    unknown = relax.op.equal(target, int64(-1))
    known = relax.op.prod(relax.op.where(unknown, int64(1), target))
    numel = relax.op.prod(dims_tensor(data))
    inferred = relax.op.floor_divide(numel, relax.op.maximum(known, int64(1)))
    resolved = bb.normalize(relax.op.where(unknown, inferred, target))
    ok = relax.op.logical_and(
        relax.op.less_equal(relax.op.sum(relax.op.astype(unknown, "int64")), int64(1)),
        relax.op.logical_and(all_of(relax.op.greater_equal(resolved, int64(0))),
                             relax.op.equal(relax.op.prod(resolved), numel)))
    out = symbolic_dims(bb, resolved, length, "reshape", bb.normalize(ok))
    return relax.op.reshape(data, relax.ShapeExpr(out))
