"""Helpers shared by the ONNX converters of this folder."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...errors import UnsupportedOpError


def node_name(attr: dict) -> str:
    """The converted node's name (as the node loop labels it)."""
    return attr["tvm_custom"]["name"]


def refuse(attr: dict, op: str, what: str) -> UnsupportedOpError:
    """An :class:`UnsupportedOpError` naming the node, its op and ``what`` (an attribute = value)."""
    return UnsupportedOpError("ONNX", [(node_name(attr), f"{op} {what}")])


def constant(value, params=None) -> np.ndarray | None:
    """The numpy value of a constant input (or a static shape value), else None."""
    value = stock.get_constant(value, params) if params is not None else value
    if isinstance(value, tvm.ir.GenericConst):
        return value.value.numpy()
    if isinstance(value, relax.ShapeExpr) and all(isinstance(v, tirx.IntImm) for v in value.values):
        return np.array([int(v) for v in value.values], dtype="int64")
    return None


def runtime_shape(bb: relax.BlockBuilder, value: relax.Expr, ndim: int, name: str) -> relax.ShapeExpr:
    """A 1-D int64 tensor (or a shape value) of ``ndim`` dims as a shape of fresh symbolic vars
    ``name0``, ``name1``, … bound at run time (``tensor_to_shape`` + ``match_cast``): ops given
    it legalize with symbolic extents, where a bare shape variable leaves them unlowered."""
    if isinstance(value, relax.ShapeExpr):
        return value
    value = bb.normalize(value)
    if isinstance(value.ty, relax.TensorType):
        if str(value.ty.dtype) != "int64":
            value = relax.op.astype(value, "int64")
        value = bb.normalize(relax.op.tensor_to_shape(value))
    dims = [tirx.Var(f"{name}{i}", "int64") for i in range(ndim)]
    bb.match_cast(value, relax.ShapeType(dims))
    return relax.ShapeExpr(dims)


def scalar_dim(bb: relax.BlockBuilder, value: relax.Expr, name: str) -> tirx.PrimExpr:
    """A scalar integer input (constant, shape dim or runtime tensor) as one (symbolic) dim."""
    known = constant(value)
    if known is not None:
        return tirx.IntImm("int64", int(known.reshape(-1)[0]))
    if tvm.ir.is_prim_expr(value):
        return value
    return runtime_shape(bb, relax.op.reshape(value, [1]), 1, name).values[0]


def dtype_of(x: relax.Expr) -> str:
    return str(x.ty.dtype)
