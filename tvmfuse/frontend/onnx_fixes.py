"""ONNX converters that replace or add to TVM 0.27's in ``from_onnx`` (:func:`converters`).

* ``Attention`` (ai.onnx): :mod:`~tvmfuse.frontend.onnx_ops.attention` (with the other ops of
  ``onnx_ops``, installed with these); :func:`node_refusals` reports what it does not handle.
* ``Unsqueeze`` (opset 13) with a 0-d ``axes`` constant: the dynamo exporter writes one for
  ``F.scaled_dot_product_attention(..., enable_gqa=True)``; 0.27 iterates the axes and fails
  with "'int' object is not iterable". The axes become a 1-element list first.
* Shape values with symbolic lengths (an LM exported with a dynamic sequence axis ``S``), where
  0.27 computes at run time and so loses every shape after: ``Range`` with a symbolic bound,
  ``Reshape`` / ``Concat`` of a scalar shape value, ``Gather`` of one shape dim, scalar shape
  values against multi-element constants in ``Add`` / ``Sub`` / ``Mul`` / ``Div``, and ``Tile``
  (the legacy exporter's GQA ``repeat_interleave``) as a broadcast / ``R.tile``. Each class says
  which exporter writes what.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from .onnx_nodes import UNROLLED, construct_nodes
from .onnx_ops import OVERRIDES as OP_OVERRIDES
from .onnx_ops import RUNTIME_INPUTS, refusals
from .onnx_ops.attention import attention_refusals
from .onnx_ops.runtime_values import with_runtime_inputs


class Unsqueeze(stock.Unsqueeze):
    """TVM's ``Unsqueeze`` with a 0-d constant ``axes`` taken as a 1-element list."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        axes = stock.get_constant(inputs[1], params)
        if isinstance(axes, tvm.ir.GenericConst) and axes.value.numpy().ndim == 0:
            value = axes.value.numpy().reshape(1)
            inputs = [inputs[0], relax.const(value, str(value.dtype)), *inputs[2:]]
        return super()._impl_v13(bb, inputs, attr, params)


class Reshape(stock.Reshape):
    """TVM's ``Reshape`` that also takes a scalar shape value (a PrimExpr such as ``S + 1``).

    The dynamo exporter reshapes ``size(1) + 1`` to ``[1]`` / ``[-1]`` / ``[]`` while building a
    causal mask; 0.27 hands the PrimExpr to ``R.reshape``, which needs a tensor. One element
    stays a shape value (``ShapeExpr([v])`` or the PrimExpr); other targets reshape a 1-element
    tensor.
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data = inputs[0]
        if tvm.ir.is_prim_expr(data):
            target = stock.get_constant(inputs[1], params)
            if isinstance(target, tvm.ir.GenericConst):
                dims = [int(d) for d in target.value.numpy().reshape(-1)]
                if not dims:
                    return data
                if len(dims) == 1 and dims[0] in (1, -1):
                    return relax.ShapeExpr([data])
            inputs = [_prim_tensor(bb, data), *inputs[1:]]
        return super()._impl_v13(bb, inputs, attr, params)


def _prim_dtype(x: tvm.ir.PrimExpr) -> str:
    return str(getattr(x, "dtype", None) or x.ty)  # a tirx.Var's dtype is its type's


def _prim_tensor(bb: relax.BlockBuilder, x: tvm.ir.PrimExpr) -> relax.Expr:
    """A scalar shape value as a 1-element tensor of its dtype."""
    t = bb.normalize(relax.op.shape_to_tensor(relax.ShapeExpr([tvm.tirx.Cast("int64", x)])))
    dtype = _prim_dtype(x)
    return t if dtype == "int64" else bb.normalize(relax.op.astype(t, dtype))


def _int_scalar(x: Any, params: Any) -> int | tvm.ir.PrimExpr | None:
    """An int or integer PrimExpr from a Range input (a constant or a shape value); else None."""
    x = stock.get_constant(x, params)
    if isinstance(x, tvm.ir.GenericConst):
        value = x.value.numpy()
        return int(value.reshape(-1)[0]) if value.size == 1 and value.dtype.kind in "iu" else None
    return x if tvm.ir.is_prim_expr(x) and _prim_dtype(x).startswith("int") else None


class Range(stock.Range):
    """TVM's ``Range`` with a symbolic integer bound kept in the output shape.

    ``Range(0, S, 1)`` (``torch.arange(seq)``): 0.27 computes the count as a tensor and gives the
    result a fresh length ``range_len_0``, unrelated to ``S``, so every shape built from it stops
    matching the model's. With integer ``start`` / ``limit`` (constants or shape values) and a
    positive constant ``delta`` this is ``R.arange(start, limit, delta)``: length
    ``ceil((limit - start) / delta)`` in the symbols.
    """

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        start, limit, delta = (_int_scalar(x, params) for x in inputs[:3])
        symbolic = any(tvm.ir.is_prim_expr(x) for x in (start, limit))
        if symbolic and None not in (start, limit) and isinstance(delta, int) and delta > 0:
            dtype = str(inputs[0].ty.dtype) if hasattr(inputs[0].ty, "dtype") else "int64"
            if not dtype.startswith("int"):
                dtype = "int64"
            return relax.op.arange(start, limit, delta, dtype)
        return super()._impl_v12(bb, inputs, attr, params)


class Gather(stock.Gather):
    """TVM's ``Gather`` that keeps one dimension of a shape value symbolic for a 1-element index.

    ``Gather(Shape(x), [i])`` (the legacy exporter's ``x.size(i)``): 0.27 turns the shape into a
    tensor and gathers at run time, so a slice bound computed from it (``x[..., : d // 2]``) has
    no static length and every shape after it is lost. Here it is the dimension itself, a PrimExpr
    (a 1-element shape value: the importer's arithmetic and ``Slice`` take those, and
    :class:`Concat` below).
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, index = inputs[0], stock.get_constant(inputs[1], params)
        if isinstance(data, relax.ShapeExpr) and isinstance(index, tvm.ir.GenericConst):
            idx = index.value.numpy()
            if idx.shape == (1,) and attr.get("axis", 0) == 0:
                return data.values[int(idx[0])]
        taken = _constant_take(data, index, attr.get("axis", 0))
        if taken is not None:
            return taken
        return super()._impl_v13(bb, inputs, attr, params)


def _constant_take(data, index, axis: int) -> relax.Expr | None:
    """``take(data, i)`` with a constant index ``i`` already wrapped (``i + n`` for ``i < 0``) when
    ``data`` has a static extent ``n`` along ``axis``; else None (TVM's Gather then wraps at run
    time). TVM's wrap is ``where(i < 0, i + take(shape_of(data), axis), i)``: scalar ops the graph
    passes cannot read until constants fold late, so torch's ``nn.MultiheadAttention`` exported to
    ONNX (q, k, v = ``Gather`` of the packed projection at 0, 1, 2) kept its batch/sequence swap
    in a kernel of its own (``PermuteRowsThroughGemm`` reads constant takes only)."""
    # constant data: TVM's converter gathers at import (a constant, which shape ops can read)
    if not isinstance(index, tvm.ir.GenericConst) or isinstance(data, tvm.ir.GenericConst):
        return None
    ty = data.ty if isinstance(data, relax.Expr) else None  # a PrimExpr: a shape value
    shape = ty.shape if isinstance(ty, relax.TensorType) else None
    if not isinstance(shape, relax.ShapeExpr):
        return None
    axis = axis + len(shape.values) if axis < 0 else axis
    extent = shape.values[axis] if 0 <= axis < len(shape.values) else None
    if not isinstance(extent, tvm.tirx.IntImm):
        return None
    idx = index.value.numpy()
    if idx.dtype.kind not in "iu":
        return None
    wrapped = np.where(idx < 0, idx + int(extent), idx)
    if wrapped.size and (wrapped.min() < 0 or wrapped.max() >= int(extent)):
        return None  # out of range: TVM's converter, as before
    # int64 whatever the model's index type (a 0-d array would otherwise become an int32 constant,
    # which TVM's take legalisation then compares against its int64 loop variables)
    return relax.op.take(data, relax.const(wrapped.astype(np.int64), "int64"), axis)


class Concat(stock.Concat):
    """TVM's ``Concat`` that takes a scalar shape value (PrimExpr) as a 1-element shape part."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        if any(tvm.ir.is_prim_expr(x) for x in inputs):
            inputs = [relax.ShapeExpr([x]) if tvm.ir.is_prim_expr(x) else x for x in inputs]
        return super()._impl_v13(bb, inputs, attr, params)


class Tile(stock.Tile):
    """TVM's ``Tile`` with constant repeats as a Relax op instead of ``emit_te(topi.tile)``::

        Tile(x, reps)  →  broadcast_to(x, shape · reps)   every repeated axis of x has length 1
                       →  R.tile(x, reps)                  otherwise

    The legacy exporter writes ``repeat_interleave(k, n, dim=1)`` (GQA) as ``Unsqueeze`` →
    ``Tile`` over the new length-1 axis → ``Reshape``: as a broadcast it is the KV repetition
    FuseAttention knows. ``emit_te`` needs a known shape (0.27 fails with "emit_te now only
    supports Tensor that has ShapeExpr shape" otherwise) and leaves a PrimFunc behind; the Relax
    ops take symbolic shapes.
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, reps = inputs[0], stock.get_constant(inputs[1], params)
        shape = data.ty.shape if isinstance(data.ty, relax.TensorType) else None
        if not isinstance(reps, tvm.ir.GenericConst) or not isinstance(shape, relax.ShapeExpr):
            return super()._impl_v13(bb, inputs, attr, params)
        reps = [int(r) for r in reps.value.numpy().reshape(-1)]
        dims = list(shape.values)
        if len(reps) == len(dims) and all(r == 1 or (isinstance(d, tvm.tirx.IntImm) and int(d) == 1)
                                          for d, r in zip(dims, reps)):
            return relax.op.broadcast_to(data, relax.ShapeExpr([d * r for d, r in zip(dims, reps)]))
        return relax.op.tile(data, reps)


def _prims_as_tensors(base: type) -> type:
    """``base`` (an elementwise ONNX converter) with scalar shape values (PrimExprs) made 1-element
    int64 tensors when another input is a constant of several elements: 0.27 folds a PrimExpr with
    constants through numpy and fails ("can only convert an array of size 1") when the result has
    more than one element. A 1-element shape value meets such a constant once :class:`Gather`
    keeps ``x.size(i)`` symbolic (BERT's legacy export multiplies it into a constant shape)."""

    class PrimsAsTensors(base):
        @classmethod
        def get_converter(cls, opset):
            impl = super().get_converter(opset)

            def convert(bb, inputs, attr, params):
                wide = any(isinstance(x, tvm.ir.GenericConst) and x.value.numpy().size > 1 for x in inputs)
                if wide and any(tvm.ir.is_prim_expr(x) for x in inputs):
                    inputs = [_prim_tensor(bb, x) if tvm.ir.is_prim_expr(x) else x for x in inputs]
                return impl(bb, inputs, attr, params)

            return convert

    PrimsAsTensors.__name__ = PrimsAsTensors.__qualname__ = base.__name__
    return PrimsAsTensors


OVERRIDES: dict[str, type] = {"Concat": Concat, "Gather": Gather, "Range": Range,
                               "Reshape": Reshape, "Tile": Tile, "Unsqueeze": Unsqueeze, **OP_OVERRIDES,
                               **{op: _prims_as_tensors(getattr(stock, op))
                                  for op in ("Add", "Sub", "Mul", "Div")}}
OVERRIDES.update({op: with_runtime_inputs(OVERRIDES.get(op) or getattr(stock, op), indices, handler)
                  for op, (indices, handler) in RUNTIME_INPUTS.items()})


@contextmanager
def converters() -> Iterator[None]:
    """TVM's ONNX converter map with :data:`OVERRIDES`, and its node loop run node by node
    (:func:`~tvmfuse.frontend.onnx_nodes.construct_nodes`), while the block runs."""
    original = stock._get_convert_map
    importer = stock.ONNXGraphImporter
    original_nodes = importer._construct_nodes

    def patched() -> dict[str, Any]:
        return {**original(), **OVERRIDES}

    stock._get_convert_map = patched
    original_check = importer._check_for_unsupported_ops
    importer._construct_nodes = construct_nodes(original_nodes)
    importer._check_for_unsupported_ops = _check_ops(original_check)
    try:
        yield
    finally:
        stock._get_convert_map = original
        importer._construct_nodes = original_nodes
        importer._check_for_unsupported_ops = original_check


def _check_ops(original):
    """0.27's check for ops without a converter, blind to the ops the node loop unrolls."""

    def check(self, graph) -> None:
        from onnx import helper

        original(self, helper.make_graph([n for n in graph.node if n.op_type not in UNROLLED],
                                         graph.name, [], []))

    return check


def node_refusals(graph) -> list[tuple[str, str]]:
    """``(node, what)`` for every standard ``Attention`` node :func:`attention_refusals` refuses,
    and every op / attribute :func:`~tvmfuse.frontend.onnx_ops.refusals.refusals` refuses."""
    from onnx import helper

    found = []
    for i, node in enumerate(graph.node):
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            for why in attention_refusals(attrs, list(node.input), list(node.output)):
                found.append((node.name or f"node#{i}", f"Attention {why}"))
    return found + refusals(graph)


__all__ = ["OVERRIDES", "Concat", "Gather", "Range", "Reshape", "Tile", "Unsqueeze",
           "converters", "node_refusals"]
