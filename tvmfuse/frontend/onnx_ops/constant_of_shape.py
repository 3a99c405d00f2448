"""ONNX ``ConstantOfShape`` with the ``input`` shape a runtime tensor (of static length ``L``).

The shape becomes symbolic dims ``fill_0 … fill_{L-1}`` at run time (negative dims fail the
call) and the output is ``broadcast_to(value, (fill_0, …))``; ``L = 0`` gives the scalar. TVM's
converter broadcasts to an untyped shape variable instead, which no later pass can read.
"""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper
from tvm import relax

from .runtime_values import Fallback, all_of, int64, static_length, symbolic_dims


def constant_of_shape_runtime(bb: relax.BlockBuilder, inputs: list, attr: dict,
                              fallback: Fallback) -> relax.Expr:
    """``ConstantOfShape(shape)`` with ``shape`` a runtime tensor (see the module docstring)."""
    shape = inputs[0]
    length = static_length(shape)
    if length is None or shape.ty.ndim != 1:
        raise ValueError(f"ConstantOfShape: a runtime shape must be 1-D of static length, got {shape.ty}")
    proto = attr.get("value")
    value = numpy_helper.to_array(proto).reshape(()) if proto is not None else np.zeros((), "float32")
    fill = relax.const(value, str(value.dtype))
    if length == 0:
        return fill
    shape = bb.normalize(relax.op.astype(shape, "int64"))
    ok = bb.normalize(all_of(relax.op.greater_equal(shape, int64(0))))
    dims = symbolic_dims(bb, shape, length, "fill", ok)
    return relax.op.broadcast_to(fill, relax.ShapeExpr(dims))
