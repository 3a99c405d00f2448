"""OrderSymbolicDefs: a binding using a data-dependent dim moves after the match_cast defining it."""

from __future__ import annotations

import numpy as np
import tvm
from onnx import TensorProto, helper
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvmfuse
from tvmfuse.passes.order_symbolic_defs import OrderSymbolicDefs


@I.ir_module(check_well_formed=False)  # what FuseOps leaves: a use before its definition
class Before:
    @R.function
    def main(x: R.Tensor((1,), "int64"), y: R.Tensor((), "float32")):
        n = T.int64()
        with R.dataflow():
            a = R.arange(0, n, 1, dtype="int64")  # FuseOps' order: before n is defined
            b = R.multiply(y, R.const(2.0, "float32"))
            s = R.tensor_to_shape(x)
            m = R.match_cast(s, R.Shape([n]))  # noqa: F841 - binds n
            R.output(a, b)
        return (a, b)


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((1,), "int64"), y: R.Tensor((), "float32")):
        n = T.int64()
        with R.dataflow():
            b = R.multiply(y, R.const(2.0, "float32"))
            s = R.tensor_to_shape(x)
            m = R.match_cast(s, R.Shape([n]))  # noqa: F841 - binds n
            a = R.arange(0, n, 1, dtype="int64")
            R.output(a, b)
        return (a, b)


def test_use_moves_after_its_match_cast():
    after = OrderSymbolicDefs()(Before)
    tvm.ir.assert_structural_equal(after, Expected)


def test_ordered_module_unchanged():
    assert OrderSymbolicDefs()(Expected)["main"].same_as(Expected["main"])


def test_data_dependent_length_compiles_and_runs():
    """``arange(float(n))·c`` with ``n`` a runtime scalar input, as the expanded HannWindow does:
    FuseOps groups the cast of ``n`` with the arange its value sizes."""
    nodes = [
        helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
        helper.make_node("Range", ["zero", "nf", "one"], ["r"]),
        helper.make_node("Mul", ["r", "nf"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("n", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
         helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    run = tvmfuse.compile(model, target="cpu").load("cpu")
    for n in (5, 9):
        got = np.asarray(run(np.array(n, dtype=np.int32)))
        np.testing.assert_allclose(got, np.arange(n, dtype=np.float32) * n)
