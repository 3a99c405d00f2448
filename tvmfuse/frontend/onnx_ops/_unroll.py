"""Helpers shared by the unrolled control-flow ops (:mod:`.scan`, :mod:`.loop`).

A body graph is converted once per step by the node loop's ``RunBody`` (the node loop passes
it: the body's inputs bound to the step's values, the outer scope visible, the body's names gone
again after the step), so every step is plain Relax ops of static shape and the unrolled graph
is fused and scheduled like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from tvm import relax, tirx

from ...errors import UnsupportedOpError

UNROLL_LIMIT = 1024  # steps: a longer scan / loop is refused rather than unrolled
# (body graph, {body input name: value}) → the body's outputs, in order
RunBody = Callable[[Any, dict[str, relax.Expr]], list[relax.Expr]]


def refuse(label: str, what: str) -> UnsupportedOpError:
    """An :class:`UnsupportedOpError` naming the node and ``what`` (op, attribute / input, why)."""
    return UnsupportedOpError("ONNX", [(label, what)])


def attributes(node) -> dict[str, Any]:
    """``node``'s attributes as Python values."""
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def static_dims(value: relax.Expr) -> list[int] | None:
    """The static shape of a tensor value, else None."""
    ty = value.ty
    shape = getattr(ty, "shape", None) if isinstance(ty, relax.TensorType) else None
    dims = getattr(shape, "values", None)
    if dims is None or not all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    return [int(d) for d in dims]


def index(bb: relax.BlockBuilder, value: relax.Expr, axis: int, i: int) -> relax.Expr:
    """``value[..., i, ...]`` along ``axis``, that axis dropped."""
    part = relax.op.strided_slice(value, [axis], [i], [i + 1])
    return bb.normalize(relax.op.squeeze(part, [axis]))


def stack(bb: relax.BlockBuilder, values: list[relax.Expr], axis: int, reverse: bool) -> relax.Expr:
    """``values`` stacked along a new ``axis`` (negative counts from the result's rank), the last
    step first when ``reverse``."""
    values = values[::-1] if reverse else values
    rank = values[0].ty.ndim + 1
    axis = axis + rank if axis < 0 else axis
    return bb.normalize(relax.op.concat([relax.op.expand_dims(v, [axis]) for v in values], axis))


def int64_scalar(i: int) -> relax.Expr:
    """An int64 0-d constant."""
    return relax.const(np.int64(i), "int64")


__all__ = ["UNROLL_LIMIT", "RunBody", "attributes", "index", "int64_scalar", "refuse", "stack",
           "static_dims"]
