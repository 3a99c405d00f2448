"""ONNX converters of tvmfuse/frontend/onnx_fixes.py for symbolic lengths: Tile, Range, Gather,
Concat and Reshape on shape values.

Each graph is what an exporter writes for a causal LM with a dynamic sequence axis ``S`` (built with
``onnx.helper``): the imported ``main`` must keep shapes in ``S`` (TVM 0.27 loses them: a fresh
``range_len_0``, ``ndim=4`` only, or an import error) and the library built for the cpu target must
match onnxruntime at two lengths.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax

import tvmfuse
from tvmfuse.frontend import import_model

LENGTHS = (3, 11)


def _const(name: str, values: list[int], dims: list[int] | None = None) -> onnx.NodeProto:
    dims = [len(values)] if dims is None else dims
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, dims,
                                                                              values))


def _model(nodes: list, inputs: list, out: str = "y", opset: int = 17) -> onnx.ModelProto:
    output = helper.make_tensor_value_info(out, TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", inputs, [output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _x(shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)


def _shape_text(mod: tvm.IRModule) -> str:
    ty = mod["main"].ret_ty
    ty = ty.fields[0] if isinstance(ty, relax.TupleType) else ty
    assert ty.shape is not None, f"output shape lost: {ty}"
    return re.sub(r"T\.int64\((-?\d+)\)", r"\1", str(list(ty.shape.values)))


def _check(model: onnx.ModelProto, tmp_path, x_shape: list, expected_shape: str, op: str | None = None):
    """Import keeps ``expected_shape`` (and ``op`` when given); cpu build == onnxruntime at LENGTHS."""
    import onnxruntime as ort

    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    imported = import_model(str(path), dynamic={"S": (1, 16)})
    assert _shape_text(imported.mod) == expected_shape
    if op is not None:
        assert op in imported.mod["main"].script()
    lm = tvmfuse.compile(str(path), target="cpu", dynamic={"S": (1, 16)}).load()
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for n in LENGTHS:
        x = rng.standard_normal([n if d == "S" else d for d in x_shape]).astype("float32")
        (ref,) = sess.run(None, {"x": x})
        np.testing.assert_allclose(np.asarray(lm(x)), ref, rtol=1e-6, atol=1e-6)


def test_tile_over_unit_axis_is_a_broadcast(tmp_path):
    """The legacy exporter's ``repeat_interleave(k, 2, dim=1)``: Unsqueeze → Tile → Reshape."""
    nodes = [
        _const("ax", [2]), _const("reps", [1, 1, 2, 1, 1]), _const("to", [0, 4, -1, 16]),
        helper.make_node("Unsqueeze", ["x", "ax"], ["u"]),
        helper.make_node("Tile", ["u", "reps"], ["t"]),
        helper.make_node("Reshape", ["t", "to"], ["y"]),
    ]
    _check(_model(nodes, [_x([2, 2, "S", 16])]), tmp_path, [2, 2, "S", 16], "[2, 4, S, 16]",
           "R.broadcast_to")


def test_tile_over_a_long_axis(tmp_path):
    nodes = [_const("reps", [1, 2, 1]), helper.make_node("Tile", ["x", "reps"], ["y"])]
    _check(_model(nodes, [_x([2, "S", 16])]), tmp_path, [2, "S", 16], "[2, S * 2, 16]", "R.tile")


def test_range_keeps_the_symbolic_length(tmp_path):
    """``arange(x.size(0))`` added to ``x``: the range is (S,), not a fresh ``range_len``."""
    nodes = [
        _const("i0", [0], []), _const("zero", [0], []), _const("one", [1], []), _const("ax", [1]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "i0"], ["s"]),
        helper.make_node("Range", ["zero", "s", "one"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["rf", "ax"], ["col"]),
        helper.make_node("Add", ["x", "col"], ["y"]),
    ]
    _check(_model(nodes, [_x(["S", 4])]), tmp_path, ["S", 4], "[S, 4]")


def test_size_arithmetic_slice_and_concat(tmp_path):
    """The legacy exporter's ``x[..., : (x.size(-1) + 1) // 2]`` (a 1-element Gather, Add, Div,
    Slice), then ``reshape(x.size(0), -1)`` (Concat of a shape dim and a constant)."""
    nodes = [
        _const("i2", [2]), _const("i0", [0]), _const("one", [1]), _const("two", [2]), _const("zero", [0]),
        _const("m1", [-1]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "i2"], ["d"], axis=0),
        helper.make_node("Add", ["d", "one"], ["d1"]),
        helper.make_node("Div", ["d1", "two"], ["half"]),
        helper.make_node("Slice", ["x", "zero", "half", "i2"], ["h"]),
        helper.make_node("Gather", ["shape", "i0"], ["b"], axis=0),
        helper.make_node("Concat", ["b", "m1"], ["to"], axis=0),
        helper.make_node("Reshape", ["h", "to"], ["y"]),
    ]
    _check(_model(nodes, [_x([2, "S", 16])]), tmp_path, [2, "S", 16], "[2, S * 8]")


def test_size_times_a_wide_constant(tmp_path):
    """``x.size(1) * [1, 2]`` (a 1-element shape value against a 2-element constant, as BERT's
    legacy export writes) is a 2-element tensor."""
    nodes = [
        _const("i1", [1]), _const("w", [1, 2]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "i1"], ["s"], axis=0),
        helper.make_node("Mul", ["s", "w"], ["m"]),
        helper.make_node("Cast", ["m"], ["y"], to=TensorProto.FLOAT),
    ]
    _check(_model(nodes, [_x([2, "S"])]), tmp_path, [2, "S"], "[2]")


@pytest.mark.parametrize("target", [[1], [-1], [], [1, 1]], ids=["to-1", "to-minus1", "to-scalar", "to-1x1"])
def test_reshape_of_a_scalar_shape_value(tmp_path, target):
    """The dynamo exporter reshapes ``x.size(1)`` (a scalar shape value) while building a mask."""
    nodes = [
        _const("i1", [1], []), _const("to", target, [len(target)]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "i1"], ["s"]),
        helper.make_node("Reshape", ["s", "to"], ["s1"]),
        helper.make_node("Cast", ["s1"], ["sf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "sf"], ["y"]),
    ]
    _check(_model(nodes, [_x([2, "S"])]), tmp_path, [2, "S"], "[2, S]")
