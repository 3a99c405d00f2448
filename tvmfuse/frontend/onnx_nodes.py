"""TVM 0.27's ONNX node loop, one node at a time (:func:`construct_nodes`).

``ONNXGraphImporter._construct_nodes`` converts the whole graph in one loop; wrapped here it is
called once per node so that, around each node,

* a failure becomes a :class:`~tvmfuse.errors.ModelError` naming the node and its op, instead of
  a bare ``AttributeError`` / ``AssertionError`` from inside a converter (and without 0.27's
  "Error converting operator ..." line on stdout);
* a shape value (``Shape``'s ``R.shape([...])``) reaching an op that takes only tensors becomes
  an int64 tensor — a constant when every dimension is known — where 0.27 raises
  "cannot handle ShapeExpr inputs" (its own comment promises the conversion);
* a graph output that is a shape value is returned as that int64 tensor;
* a node whose inputs are all constants (a static shape value counts) is evaluated at import by
  onnx's reference evaluator at the model's opset and becomes constants (:func:`fold_node`):
  the shape arithmetic of exported and function-expanded graphs then reaches ``Reshape``,
  ``Reduce*`` axes, ``Pad`` pads and the like as the constants their converters require. A
  ``Concat`` that mixes shape values with tensors gets tensors;
* ``Size`` of a tensor of static shape is a constant (:func:`static_size`);
* an ``If`` whose condition is a constant (shape arithmetic of function-expanded graphs) is
  replaced by the nodes of the branch it takes (:func:`taken_branch`): the other branch, built
  for other ranks or dtypes, is never converted;
* a ``Scan`` / ``Loop`` is unrolled: its body converted once per step with the step's values
  (:func:`unrolled`, :mod:`~tvmfuse.frontend.onnx_ops.scan`, :mod:`~tvmfuse.frontend.onnx_ops.loop`);
* a shape-like input a converter needs constant (``SplitToSequence`` split) that is a runtime
  tensor is refused naming the node, the op and the input
  (:mod:`~tvmfuse.frontend.onnx_ops.static_inputs`); the others are resolved at run time
  (``onnx_ops.RUNTIME_INPUTS``).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax, tirx

from ..errors import ModelError, TvmfuseError, UnsupportedOpError
from .onnx_ops.loop import unroll_loop
from .onnx_ops.scan import unroll_scan
from .onnx_ops.static_inputs import runtime_refusals

_FOLD_LIMIT = 1 << 20  # elements: constant inputs beyond this are left to the converters
_RANDOM_OPS = {"Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform",
               "RandomUniformLike"}
# The ops whose 0.27 converters take a shape value (the list in ``_construct_nodes``).
_SHAPE_OPS = {"Reshape", "Resize", "ConstantOfShape", "Gather", "Slice", "Shape", "Expand",
              "Concat", "Equal", "Where", "Cast", "CastLike", "Squeeze"}


@dataclass
class _OneNode:
    """What ``_construct_nodes`` reads of a graph: its nodes."""

    node: list


def node_label(node) -> str:
    """A node's name, or its first output's when the node is unnamed."""
    return node.name or (f"<output {node.output[0]}>" if node.output else "<unnamed>")


def _is_shape(value: Any) -> bool:
    return isinstance(value, relax.Expr) and isinstance(value.ty, relax.ShapeType)


def _shape_like(value: Any) -> bool:
    """A shape value, one dim of one (a PrimExpr), or an int64 vector constant."""
    if _is_shape(value) or tvm.ir.is_prim_expr(value):
        return True
    return (isinstance(value, tvm.ir.GenericConst) and value.ty.ndim == 1
            and str(value.ty.dtype) == "int64")


def shape_tensor(bb: relax.BlockBuilder, value: relax.Expr) -> relax.Expr:
    """A shape value as an int64 tensor of its dims (a constant when all are known)."""
    values = getattr(value, "values", None)
    if values is not None and all(isinstance(v, tirx.IntImm) for v in values):
        return relax.const(np.array([int(v) for v in values], dtype="int64"), "int64")
    return bb.normalize(relax.op.shape_to_tensor(value))


def _constant(value: Any) -> np.ndarray | None:
    """The numpy value of a constant or static shape value, else None."""
    if isinstance(value, tvm.ir.GenericConst):
        return value.value.numpy()
    values = getattr(value, "values", None) if _is_shape(value) else None
    if values is not None and all(isinstance(v, tirx.IntImm) for v in values):
        return np.array([int(v) for v in values], dtype="int64")
    return None


def fold_node(node, nodes: dict[str, Any], opset: int) -> dict[str, relax.Expr] | None:
    """``node``'s outputs as constants when all its inputs are constant, else None."""
    if (node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM_OPS
            or any(a.HasField("g") or a.graphs for a in node.attribute)):
        return None
    feeds = {}
    for name in node.input:
        if name:
            value = _constant(nodes.get(name))
            if value is None:
                return None
            feeds[name] = value
    if sum(v.size for v in feeds.values()) > _FOLD_LIMIT:
        return None
    from onnx.reference import ReferenceEvaluator

    try:
        results = ReferenceEvaluator(node, opsets={"": opset}).run(None, feeds)
    except Exception:  # noqa: BLE001 - the reference cannot run it: leave it to the converter
        return None
    folded = {}
    for name, value in zip(node.output, results):
        if not name:
            continue
        if not isinstance(value, np.ndarray | np.generic) or value.dtype.kind not in "biuf":
            return None
        value = np.asarray(value)
        folded[name] = relax.const(value, value.dtype.name)
    return folded


def static_size(node, nodes: dict[str, Any]) -> dict[str, relax.Expr] | None:
    """``Size`` of a tensor whose shape is static, as an int64 constant (its data may be a runtime
    input: only the shape is read), else None."""
    if node.op_type != "Size" or node.domain not in ("", "ai.onnx") or not node.output:
        return None
    value = nodes.get(node.input[0])
    ty = getattr(value, "ty", None) if isinstance(value, relax.Expr) else None
    dims = getattr(getattr(ty, "shape", None), "values", None) if isinstance(ty, relax.TensorType) else None
    if dims is None or not all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    return {node.output[0]: relax.const(np.int64(np.prod([int(d) for d in dims])), "int64")}


def taken_branch(node, nodes: dict[str, Any]):
    """The subgraph an ``If`` node takes when its condition is a constant, else None."""
    if node.op_type != "If" or node.domain not in ("", "ai.onnx") or not node.input:
        return None
    cond = _constant(nodes.get(node.input[0]))
    if cond is None or cond.size != 1:
        return None
    name = "then_branch" if bool(cond.reshape(())) else "else_branch"
    return next((a.g for a in node.attribute if a.name == name), None)


UNROLLED = {"Scan", "Loop"}  # converted here, step by step, not by a converter of the map


def _run_body(self, run: Callable, graph, bindings: dict[str, Any]) -> list[relax.Expr]:
    """``graph`` (a Scan / Loop body) converted once with its inputs bound to ``bindings``: the
    outer scope is visible, and the body's own names are gone again after (the next step binds
    them anew)."""
    outer = dict(self._nodes)
    try:
        for init in graph.initializer:
            self._nodes[init.name] = relax.const(self._parse_array(init))
        self._nodes.update(bindings)
        run(self, graph)
        return [self._nodes[out.name] for out in graph.output]
    finally:
        self._nodes = outer


def unrolled(self, run: Callable, node) -> list[relax.Expr] | None:
    """The outputs of a ``Scan`` / ``Loop`` node unrolled into its steps, else None."""
    if node.op_type not in UNROLLED or node.domain not in ("", "ai.onnx"):
        return None
    inputs = [self._nodes[name] if name else None for name in node.input]
    inputs = [shape_tensor(self.bb, x) if _is_shape(x) else x for x in inputs]

    def body(graph, bindings: dict[str, Any]) -> list[relax.Expr]:
        return _run_body(self, run, graph, bindings)

    if node.op_type == "Scan":
        return unroll_scan(self.bb, node, node_label(node), inputs, self.opset, body)
    return unroll_loop(self.bb, node, node_label(node), inputs, _constant, body, self._nodes)


def construct_nodes(original: Callable) -> Callable:
    """``ONNXGraphImporter._construct_nodes`` run node by node (see the module docstring)."""

    def run(self, graph) -> None:
        for node in graph.node:
            folded = fold_node(node, self._nodes, self.opset) or static_size(node, self._nodes)
            if folded is not None:
                self._nodes.update(folded)
                continue
            branch = taken_branch(node, self._nodes)
            if branch is not None:  # If on a constant: only the branch taken is converted, inline
                run(self, branch)
                for out, value in zip(node.output, branch.output):
                    if out:
                        self._nodes[out] = self._nodes[value.name]
                continue
            outputs = unrolled(self, run, node)
            if outputs is not None:  # Scan / Loop: the body converted once per step, inline
                self._nodes.update((name, value) for name, value in zip(node.output, outputs) if name)
                continue
            refused = runtime_refusals(node, self._nodes, self.opset)
            if refused:
                raise UnsupportedOpError("ONNX", [(node_label(node), "; ".join(refused))])
            saved = {}
            # a Concat of shape values (ShapeExprs, the dims onnx_fixes.Gather keeps as PrimExprs)
            # and int64 constants stays a shape value; with a runtime tensor it concatenates tensors
            mixed = node.op_type == "Concat" and not all(
                _shape_like(self._nodes.get(n)) for n in node.input if n)
            if node.op_type not in _SHAPE_OPS or mixed:
                for name in node.input:
                    if _is_shape(self._nodes.get(name)):
                        saved[name] = self._nodes[name]
                        self._nodes[name] = shape_tensor(self.bb, saved[name])
            try:
                # 0.27 prints "Error converting operator ..." before re-raising: the error says it
                with contextlib.redirect_stdout(io.StringIO()):
                    original(self, _OneNode([node]))
            except TvmfuseError:
                raise
            except Exception as err:  # converters raise every kind; name the node and op
                raise ModelError(f"ONNX node {node_label(node)!r} (op {node.op_type}): "
                                 f"{type(err).__name__}: {err}") from err
            finally:
                self._nodes.update(saved)  # shape-taking consumers still see the shape value
        for out in getattr(graph, "output", ()):
            if _is_shape(self._nodes.get(out.name)):
                self._nodes[out.name] = shape_tensor(self.bb, self._nodes[out.name])

    return run


__all__ = ["UNROLLED", "construct_nodes", "node_label", "shape_tensor"]
