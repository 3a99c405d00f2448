"""ONNX ``Range`` with ``start``, ``limit`` or ``delta`` a runtime scalar.

The length is computed at run time as ONNX defines it and becomes the symbolic dim ``range_0``
(``delta = 0`` fails the call)::

    n      = max(ceil((limit - start) / delta), 0)      (float64 for float types; exact for ints)
    out[i] = start + i · delta                           (one TE kernel, in the inputs' dtype)

TVM's converter binds the length the same way but its shape variable is lost by the binding
canonicalisation (the compiled function then reads an undefined dim).
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx

from .runtime_values import Fallback, symbolic_dims


def _scalar(bb: relax.BlockBuilder, x, dtype: str) -> relax.Expr:
    """A Range input (tensor, constant or shape value) as a 0-D tensor of ``dtype``."""
    if tvm.ir.is_prim_expr(x):
        x = relax.op.shape_to_tensor(relax.ShapeExpr([tirx.Cast("int64", x)]))
    x = relax.op.reshape(x, [])
    return bb.normalize(relax.op.astype(x, dtype))


def range_runtime(bb: relax.BlockBuilder, inputs: list, attr: dict, fallback: Fallback) -> relax.Expr:
    """``Range(start, limit, delta)`` with a runtime input (see the module docstring)."""
    dtype = next(str(x.ty.dtype) for x in inputs if isinstance(x, relax.Expr) and not tvm.ir.is_prim_expr(x))
    floating = dtype.startswith(("float", "bfloat"))
    count_dtype = "float64" if floating else "int64"
    start, limit, delta = (_scalar(bb, x, count_dtype) for x in inputs[:3])
    if floating:
        count = relax.op.ceil(relax.op.divide(relax.op.subtract(limit, start), delta))
    else:  # ceil((limit - start) / delta) = -floor((start - limit) / delta)
        count = relax.op.negative(relax.op.floor_divide(relax.op.subtract(start, limit), delta))
    count = relax.op.astype(relax.op.maximum(count, relax.const(0, count_dtype)), "int64")
    ok = relax.op.not_equal(delta, relax.const(0, count_dtype))
    (length,) = symbolic_dims(bb, count, 1, "range", bb.normalize(ok))

    def arange(first: te.Tensor, step: te.Tensor, size: tirx.PrimExpr) -> te.Tensor:
        return te.compute([size], lambda i: first[()] + tirx.Cast(dtype, i) * step[()], name="range")

    first, step = (_scalar(bb, x, dtype) for x in (inputs[0], inputs[2]))
    return bb.emit_te(arange, first, step, length)
