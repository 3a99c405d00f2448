"""ONNX converters of ops TVM 0.27 lacks (CumProd, NonMaxSuppression, TfIdfVectorizer, Det) on
cases the ONNX node tests miss, compared with onnx's reference evaluator on random inputs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import tvmfuse


def _model(node, inputs, outputs, inits=(), opset=26):
    graph = helper.make_graph([node], "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _check(model, feeds: dict, exact: bool = False, runs=None):
    """tvmfuse's outputs against the reference evaluator's, for one or more feeds."""
    run = tvmfuse.compile(model, target="cpu").load("cpu")
    ref = ReferenceEvaluator(model)
    for feed in runs or [feeds]:
        got = run(*feed.values())
        got = [np.asarray(g) for g in got] if isinstance(got, tuple | list) else [np.asarray(got)]
        for g, w in zip(got, ref.run(None, feed), strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            if exact:
                np.testing.assert_array_equal(g, w)
            else:
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod_constant_axis(exclusive, reverse):
    """A constant (negative) axis of a 3-D tensor, with exclusive / reverse."""
    node = helper.make_node("CumProd", ["x", "a"], ["y"], exclusive=exclusive, reverse=reverse)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 3])],
                   [helper.make_tensor("a", TensorProto.INT64, [], [-2])])
    x = np.random.default_rng(exclusive + 2 * reverse).uniform(0.5, 1.5, (2, 5, 3)).astype(np.float32)
    _check(model, {"x": x})


def test_cumprod_runtime_axis_each_axis():
    """One library, every axis of a 3-D int tensor chosen at run time (negative ones too)."""
    node = helper.make_node("CumProd", ["x", "a"], ["y"], reverse=1)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.INT32, [2, 3, 4]),
                          helper.make_tensor_value_info("a", TensorProto.INT64, [])],
                   [helper.make_tensor_value_info("y", TensorProto.INT32, [2, 3, 4])])
    x = np.random.default_rng(0).integers(-3, 4, (2, 3, 4)).astype(np.int32)
    _check(model, {}, exact=True,
           runs=[{"x": x, "a": np.array(a, np.int64)} for a in (0, 1, 2, -1, -3)])
