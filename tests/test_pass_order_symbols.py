"""OrderSymbolDefinitions: a binding that reads a match_cast-bound symbol moves after it."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvmfuse.passes.order_symbols import OrderSymbolDefinitions


@I.ir_module(check_well_formed=False)
class Before:
    @T.prim_func(private=True, s_tir=True)
    def iota(var_out: T.handle):
        n = T.int64()
        out = T.match_buffer(var_out, (n,), "float32")
        for i in range(n):
            with T.sblock("iota"):
                vi = T.axis.spatial(n, i)
                out[vi] = T.Cast("float32", vi)

    @R.function
    def main(t: R.Tensor((1,), "int64")) -> R.Tensor(dtype="float32", ndim=1):
        n = T.int64()
        cls = Before
        with R.dataflow():
            # where FuseOps leaves a group with no Relax input from after the match_cast
            y = R.call_tir(cls.iota, (), out_ty=R.Tensor((n,), "float32"))
            s = R.call_pure_packed("vm.builtin.tensor_to_shape", t, ty_args=(R.Shape(ndim=1),))
            m = R.match_cast(s, R.Shape([n]))  # noqa: F841 - binds n
            R.output(y)
        return y


@I.ir_module
class Expected:
    @T.prim_func(private=True, s_tir=True)
    def iota(var_out: T.handle):
        n = T.int64()
        out = T.match_buffer(var_out, (n,), "float32")
        for i in range(n):
            with T.sblock("iota"):
                vi = T.axis.spatial(n, i)
                out[vi] = T.Cast("float32", vi)

    @R.function
    def main(t: R.Tensor((1,), "int64")) -> R.Tensor(dtype="float32", ndim=1):
        n = T.int64()
        cls = Expected
        with R.dataflow():
            s = R.call_pure_packed("vm.builtin.tensor_to_shape", t, ty_args=(R.Shape(ndim=1),))
            m = R.match_cast(s, R.Shape([n]))  # noqa: F841 - binds n
            y = R.call_tir(cls.iota, (), out_ty=R.Tensor((n,), "float32"))
            R.output(y)
        return y


def test_use_moves_after_definition():
    tvm.ir.assert_structural_equal(OrderSymbolDefinitions()(Before), Expected)


def test_ordered_module_unchanged_and_input_untouched():
    before_text = Before.script()
    out = OrderSymbolDefinitions()(Expected)
    tvm.ir.assert_structural_equal(out, Expected)
    OrderSymbolDefinitions()(Before)
    assert Before.script() == before_text  # the pass never writes into its input


def test_reordered_module_runs():
    ex = tvm.compile(OrderSymbolDefinitions()(Before), target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for n in (3, 7):
        got = vm["main"](tvm.runtime.tensor(np.array([n], "int64"))).numpy()
        np.testing.assert_array_equal(got, np.arange(n, dtype="float32"))
