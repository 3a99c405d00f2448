"""ONNX Constant given by value_int(s) / value_float(s) inside an If branch (the node loop folds
top-level constants; subgraphs reach the converter)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import tvmfuse


def test_if_branches_with_scalar_and_list_constants():
    f = TensorProto.FLOAT
    then = helper.make_graph([helper.make_node("Constant", [], ["c"], value_ints=[1, 2, 3]),
                              helper.make_node("Cast", ["c"], ["cf"], to=f),
                              helper.make_node("Add", ["x", "cf"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", f, [3])])
    other = helper.make_graph([helper.make_node("Constant", [], ["d"], value_float=2.5),
                               helper.make_node("Mul", ["x", "d"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", f, [3])])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                                            helper.make_tensor_value_info("x", f, [3])],
                              [helper.make_tensor_value_info("y", f, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    run = tvmfuse.compile(model, target="cpu").load("cpu")
    x = np.array([1.0, 5.0, -3.0], "float32")
    for cond in (True, False):
        want = ReferenceEvaluator(model).run(None, {"cond": np.array(cond), "x": x})[0]
        np.testing.assert_allclose(np.asarray(run(np.array(cond), x)), want, rtol=1e-6)
