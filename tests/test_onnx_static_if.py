"""The node loop's static shape folds: ``Size`` of a runtime tensor of static shape is a constant,
and an ``If`` on such a constant converts only the branch it takes (the other branch, written
for another rank, would not convert)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import tvmfuse

F = TensorProto.FLOAT


def test_if_on_size_takes_one_branch():
    # then: x is 2-D -> transpose (a 3-D perm in the other branch would fail to convert)
    then = helper.make_graph([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0])], "then", [],
                             [helper.make_tensor_value_info("t", F, None)])
    other = helper.make_graph([helper.make_node("Transpose", ["x"], ["e"], perm=[2, 0, 1])], "else", [],
                              [helper.make_tensor_value_info("e", F, None)])
    nodes = [helper.make_node("Size", ["x"], ["n"]),
             helper.make_node("Equal", ["n", "six"], ["is_2x3"]),
             helper.make_node("If", ["is_2x3"], ["y"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 3])],
                              [helper.make_tensor_value_info("y", F, None)],
                              [helper.make_tensor("six", TensorProto.INT64, [], [6])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    run = tvmfuse.compile(model, target="cpu").load("cpu")
    x = np.arange(6, dtype="float32").reshape(2, 3) - 2.5
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_array_equal(np.asarray(run(x)), want)
