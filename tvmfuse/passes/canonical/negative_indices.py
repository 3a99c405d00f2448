"""Constant negative indices count from the end, as in torch and ONNX.

    take(x, const(-2), axis=3)                  x: (B, S, G, 4, D)
      → take(x, const(2), axis=3)
    index_tensor(x, (const([[-1]]), i))         x: (B, S, D)
      → index_tensor(x, (const([[B - 1]]), i))

TVM 0.27's torch importer converts ``x[..., -2, :]`` (``select.int``) and ``x[:, [-1]]``
(``index.Tensor`` with a constant index) to these ops without wrapping the index, and ``take``'s
default "fast" mode reads ``x`` at a negative offset: silently wrong numbers (transformers'
Falcon with the new decoder architecture splits K and V with ``grouped[..., -2, :]`` and
``grouped[..., -1, :]``; NaN or relative error 0.5–1 on the cpu target). Here a constant index
with a negative entry becomes ``index + size`` on an axis of static size, and a ``take`` on a
symbolic axis wraps (``mode="wrap"``). Indices computed at run time are left as they come. First
in the canonical list: every later pass sees in-range constants.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._util import is_op
from ._common import rewrite_relax_functions


def _axis_size(x: relax.Expr, axis: int) -> int | None:
    """The static size of ``x``'s ``axis`` (None: symbolic or unknown rank)."""
    shape = getattr(x.ty, "shape", None)
    values = getattr(shape, "values", None)
    if values is None:
        return None
    dim = values[axis % len(values)]
    return int(dim.value) if isinstance(dim, tvm.tirx.IntImm) else None


def _negative(index: relax.Expr) -> np.ndarray | None:
    """The values of a constant integer index with a negative entry, else None."""
    if not (isinstance(index, Constant) and isinstance(index.value, tvm.runtime.Tensor)):
        return None
    values = index.value.numpy()
    if values.dtype.kind != "i" or not (values < 0).any():
        return None
    return values


def _wrapped(values: np.ndarray, size: int) -> relax.Expr:
    wrapped = np.asarray(np.where(values < 0, values + size, values), dtype=values.dtype)
    return relax.const(wrapped, str(values.dtype))


@mutator
class _Wrap(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if is_op(call, "relax.take"):
            return self._take(call)
        if is_op(call, "relax.index_tensor") and isinstance(call.args[1], relax.Tuple):
            return self._index_tensor(call)
        return call

    def _take(self, call: relax.Call) -> relax.Expr:
        x, index = call.args
        values = _negative(index)
        if values is None:
            return call
        axis = int(call.attrs.axis) if call.attrs.axis is not None else None
        size = _axis_size(x, axis) if axis is not None else None
        if size is not None:
            return relax.op.take(x, _wrapped(values, size), axis, mode=str(call.attrs.mode))
        return relax.op.take(x, index, axis, mode="wrap")

    def _index_tensor(self, call: relax.Call) -> relax.Expr:
        x, indices = call.args[0], list(call.args[1].fields)
        changed = False
        for axis, index in enumerate(indices):
            values = _negative(index)
            size = _axis_size(x, axis) if values is not None else None
            if size is not None:
                indices[axis], changed = _wrapped(values, size), True
        return relax.op.index_tensor(x, relax.Tuple(indices)) if changed else call


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.NegativeIndices")
class NegativeIndices:
    """Constant negative ``take`` / ``index_tensor`` indices → their non-negative equivalents."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_relax_functions(mod, lambda m, f: _Wrap(m).visit_expr(f))
