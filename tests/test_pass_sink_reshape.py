"""SinkReshape: a reshape between a GEMM and its epilogue moves below the epilogue."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tests.relax_util import apply_pass, assert_same_numerics
from tvmfuse.passes import SinkReshape


@I.ir_module
class LinearResidual:
    """torch.export's Linear on (2, 8, 16): reshape → matmul → reshape → add bias → add residual."""

    @R.function
    def main(x: R.Tensor((2, 8, 16), "float32"), w: R.Tensor((16, 32), "float32"),
             b: R.Tensor((32,), "float32"), r: R.Tensor((2, 8, 32), "float32")
             ) -> R.Tensor((2, 8, 32), "float32"):
        with R.dataflow():
            x2 = R.reshape(x, R.shape([16, 16]))
            mm = R.matmul(x2, w)
            mm3 = R.reshape(mm, R.shape([2, 8, 32]))
            biased = R.add(mm3, b)
            act = R.nn.gelu(biased)
            y = R.add(act, r)
            R.output(y)
        return y


@I.ir_module
class LinearResidualExpected:
    @R.function
    def main(x: R.Tensor((2, 8, 16), "float32"), w: R.Tensor((16, 32), "float32"),
             b: R.Tensor((32,), "float32"), r: R.Tensor((2, 8, 32), "float32")
             ) -> R.Tensor((2, 8, 32), "float32"):
        with R.dataflow():
            x2 = R.reshape(x, R.shape([16, 16]))
            mm = R.matmul(x2, w)
            biased = R.add(mm, b)
            act = R.nn.gelu(biased)
            r2 = R.reshape(r, R.shape([16, 32]))
            y2 = R.add(act, r2)
            y = R.reshape(y2, R.shape([2, 8, 32]))
            R.output(y)
        return y


@I.ir_module
class ReshapeChangesLastAxis:
    """The reshape regroups the last axis: a per-column bias no longer lines up, leave it."""

    @R.function
    def main(x: R.Tensor((16, 32), "float32"), w: R.Tensor((32, 32), "float32"),
             b: R.Tensor((64,), "float32")) -> R.Tensor((8, 64), "float32"):
        with R.dataflow():
            mm = R.matmul(x, w)
            mm2 = R.reshape(mm, R.shape([8, 64]))
            y = R.add(mm2, b)
            R.output(y)
        return y


@I.ir_module
class SymbolicLinearResidual:
    """The same with S symbolic (``--dynamic``): shapes compare structurally."""

    @R.function
    def main(x: R.Tensor((1, "S", 16), "float32"), w: R.Tensor((16, 32), "float32"),
             r: R.Tensor((1, "S", 32), "float32")) -> R.Tensor((1, "S", 32), "float32"):
        S = T.int64()
        with R.dataflow():
            x2 = R.reshape(x, R.shape([S, 16]))
            mm = R.matmul(x2, w)
            mm3 = R.reshape(mm, R.shape([1, S, 32]))
            y = R.add(mm3, r)
            R.output(y)
        return y


@I.ir_module
class SymbolicLinearResidualExpected:
    @R.function
    def main(x: R.Tensor((1, "S", 16), "float32"), w: R.Tensor((16, 32), "float32"),
             r: R.Tensor((1, "S", 32), "float32")) -> R.Tensor((1, "S", 32), "float32"):
        S = T.int64()
        with R.dataflow():
            x2 = R.reshape(x, R.shape([S, 16]))
            mm = R.matmul(x2, w)
            r2 = R.reshape(r, R.shape([S, 32]))
            y2 = R.add(mm, r2)
            y = R.reshape(y2, R.shape([1, S, 32]))
            R.output(y)
        return y


def test_symbolic_linear_residual():
    after = apply_pass(SinkReshape(), SymbolicLinearResidual)
    after = tvm.relax.transform.CanonicalizeBindings()(after)
    tvm.ir.assert_structural_equal(after, SymbolicLinearResidualExpected)
    assert_same_numerics(SymbolicLinearResidual, after)


def test_linear_epilogue_and_residual():
    after = apply_pass(SinkReshape(), LinearResidual)
    after = tvm.relax.transform.CanonicalizeBindings()(after)
    tvm.ir.assert_structural_equal(after, LinearResidualExpected)
    assert_same_numerics(LinearResidual, after)


def test_regrouped_last_axis_is_left_alone():
    after = apply_pass(SinkReshape(), ReshapeChangesLastAxis)
    tvm.ir.assert_structural_equal(after, ReshapeChangesLastAxis)


def test_fewer_kernels_for_torch_linear():
    """End to end: the torch Linear + residual becomes one GEMM-epilogue kernel."""
    import torch

    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.nn.functional.gelu(self.lin(x)) + x

    report = analyze(import_model(Block(), (torch.randn(2, 8, 16),)).mod, get_target("sm90"))
    assert report["fused_kernel_count"] == 1
    assert report["kernels"][0]["pattern"] == "gemm_epilogue"
    assert report["kernels"][0]["ops"] == ["matmul", "add", "gelu", "add"]


@I.ir_module
class TanhGeluHops:
    """HF GPT-2's tanh-GELU as exported: the chain hops between 2-D and 3-D around the GEMM output."""

    @R.function
    def main(x: R.Tensor((16, 8), "float32"), w: R.Tensor((8, 32), "float32")
             ) -> R.Tensor((16, 32), "float32"):
        with R.dataflow():
            h = R.matmul(x, w)
            h3 = R.reshape(h, R.shape([2, 8, 32]))
            cube = R.power(h3, R.const(3.0, "float32"))
            small = R.multiply(cube, R.const(0.044715, "float32"))
            small2 = R.reshape(small, R.shape([16, 32]))
            inner = R.add(h, small2)
            t = R.tanh(R.multiply(inner, R.const(0.7978845608, "float32")))
            half = R.reshape(R.multiply(h, R.const(0.5, "float32")), R.shape([2, 8, 32]))
            one = R.reshape(R.add(t, R.const(1.0, "float32")), R.shape([2, 8, 32]))
            y3 = R.multiply(half, one)
            y = R.reshape(y3, R.shape([16, 32]))
            R.output(y)
        return y


@I.ir_module
class TanhGeluFlat:
    @R.function
    def main(x: R.Tensor((16, 8), "float32"), w: R.Tensor((8, 32), "float32")
             ) -> R.Tensor((16, 32), "float32"):
        with R.dataflow():
            h = R.matmul(x, w)
            cube = R.power(h, R.const(3.0, "float32"))
            small = R.multiply(cube, R.const(0.044715, "float32"))
            inner = R.add(h, small)
            t = R.tanh(R.multiply(inner, R.const(0.7978845608, "float32")))
            half = R.multiply(h, R.const(0.5, "float32"))
            one = R.add(t, R.const(1.0, "float32"))
            y = R.multiply(half, one)
            R.output(y)
        return y


def test_reshapes_inside_an_elementwise_chain_cancel():
    """Every reshape of the chain cancels: the whole GELU becomes the GEMM's epilogue."""
    after = apply_pass(SinkReshape(), TanhGeluHops)
    after = tvm.relax.transform.CanonicalizeBindings()(after)
    after = tvm.relax.transform.DeadCodeElimination()(after)
    tvm.ir.assert_structural_equal(after, TanhGeluFlat)
    assert_same_numerics(TanhGeluHops, after)


@I.ir_module
class OuterDifference:
    """ONNX Trilu with a runtime k: ``arange(n)`` as a row minus itself as a column, (n, n)."""

    @R.function
    def main(k: R.Tensor((), "int64")) -> R.Tensor((3, 3), "bool"):
        with R.dataflow():
            idx = R.arange(0, 3, 1, dtype="int64")
            row = R.reshape(idx, R.shape([1, 3]))
            col = R.reshape(idx, R.shape([3, 1]))
            diff = R.subtract(row, col)
            y = R.less_equal(diff, k)
            R.output(y)
        return y


def test_reshapes_broadcast_against_each_other_stay():
    """Both operands are reshapes of one tensor to different shapes: the op broadcasts them to
    (3, 3), so sinking one reshape (to (1, 3)) would change the result."""
    after = apply_pass(SinkReshape(), OuterDifference)
    tvm.ir.assert_structural_equal(after, OuterDifference)
    assert_same_numerics(OuterDifference, after)


@I.ir_module
class GateUpChunk:
    """HF Phi-3's MLP on (1, 8, 16): one gate/up GEMM, reshaped to 3-D, ``chunk(2, -1)``."""

    @R.function
    def main(x: R.Tensor((8, 16), "float32"), w: R.Tensor((16, 64), "float32")
             ) -> R.Tensor((1, 8, 32), "float32"):
        with R.dataflow():
            mm = R.matmul(x, w)
            mm3 = R.reshape(mm, R.shape([1, 8, 64]))
            parts = R.split(mm3, indices_or_sections=[32], axis=-1)
            gate = parts[0]
            up = parts[1]
            y = R.multiply(up, R.nn.silu(gate))
            R.output(y)
        return y


@I.ir_module
class GateUpChunkExpected:
    @R.function
    def main(x: R.Tensor((8, 16), "float32"), w: R.Tensor((16, 64), "float32")
             ) -> R.Tensor((1, 8, 32), "float32"):
        with R.dataflow():
            mm = R.matmul(x, w)
            gate = R.strided_slice(mm, (1,), (0,), (32,), assume_inbound=True)
            up = R.strided_slice(mm, (1,), (32,), (64,), assume_inbound=True)
            act = R.nn.silu(gate)
            y2 = R.multiply(up, act)
            y = R.reshape(y2, R.shape([1, 8, 32]))
            R.output(y)
        return y


@I.ir_module
class GateUpSlices:
    """The same halves as ``y[..., :32]`` and ``y[..., 32:]`` (an open end past the axis)."""

    @R.function
    def main(x: R.Tensor((8, 16), "float32"), w: R.Tensor((16, 64), "float32")
             ) -> R.Tensor((1, 8, 32), "float32"):
        with R.dataflow():
            mm = R.matmul(x, w)
            mm3 = R.reshape(mm, R.shape([1, 8, 64]))
            gate = R.strided_slice(mm3, (2,), (0,), (32,), (1,))
            up = R.strided_slice(mm3, (2,), (32,), (9223372036854775807,), (1,))
            y = R.multiply(up, R.nn.silu(gate))
            R.output(y)
        return y


def test_gate_up_halves_take_the_reshape_down():
    """A split / slice along the last axis of a GEMM's reshaped output goes before the reshape,
    which then sinks below the SwiGLU (PairGemm sees the GEMM's 2-D halves)."""
    after = tvm.relax.transform.CanonicalizeBindings()(apply_pass(SinkReshape(), GateUpChunk))
    after = tvm.relax.transform.DeadCodeElimination()(after)
    tvm.ir.assert_structural_equal(after, GateUpChunkExpected)
    assert_same_numerics(GateUpChunk, after)
    sliced = apply_pass(SinkReshape(), GateUpSlices)
    text = sliced.script()
    assert "R.reshape(mm" not in text and text.count("R.strided_slice(mm,") == 2, text
    assert_same_numerics(GateUpSlices, sliced)


@I.ir_module
class SliceRegroupsLastAxis:
    """The reshape regroups the last axis: slicing before it would cut other columns."""

    @R.function
    def main(x: R.Tensor((8, 16), "float32"), w: R.Tensor((16, 64), "float32")
             ) -> R.Tensor((8, 2, 16), "float32"):
        with R.dataflow():
            mm = R.matmul(x, w)
            mm3 = R.reshape(mm, R.shape([8, 2, 32]))
            y = R.strided_slice(mm3, (2,), (0,), (16,), (1,))
            R.output(y)
        return y


def test_slice_of_a_regrouped_last_axis_is_left_alone():
    after = apply_pass(SinkReshape(), SliceRegroupsLastAxis)
    tvm.ir.assert_structural_equal(after, SliceRegroupsLastAxis)


@I.ir_module
class ComputedMinusLinear:
    """``c − Linear(x)`` and ``Linear(x) / c`` with ``c`` computed in the function (bound to a
    var, as Apertus's xIELU ``expm1(min(x, eps)) − x`` is): the operands keep their order."""

    @R.function
    def main(x: R.Tensor((16, 32), "float32"), w: R.Tensor((32, 32), "float32"),
             r: R.Tensor((2, 8, 32), "float32")) -> R.Tensor((2, 8, 32), "float32"):
        with R.dataflow():
            mm = R.matmul(x, w)
            mm3 = R.reshape(mm, R.shape([2, 8, 32]))
            c = R.exp(r)
            d = R.subtract(c, mm3)
            y = R.divide(mm3, d)
            R.output(y)
        return y


@I.ir_module
class ComputedMinusLinearExpected:
    @R.function
    def main(x: R.Tensor((16, 32), "float32"), w: R.Tensor((32, 32), "float32"),
             r: R.Tensor((2, 8, 32), "float32")) -> R.Tensor((2, 8, 32), "float32"):
        with R.dataflow():
            mm = R.matmul(x, w)
            c = R.exp(r)
            c2 = R.reshape(c, R.shape([16, 32]))
            d2 = R.subtract(c2, mm)
            y2 = R.divide(mm, d2)
            y = R.reshape(y2, R.shape([2, 8, 32]))
            R.output(y)
        return y


def test_operand_order_kept_for_a_computed_left_operand():
    """Session 42: the computed operand came out on the other side (``mm − c``): Apertus's
    logits were 2e-1 off on every target, with no error."""
    after = apply_pass(SinkReshape(), ComputedMinusLinear)
    after = tvm.relax.transform.CanonicalizeBindings()(after)
    after = tvm.relax.transform.DeadCodeElimination()(after)
    tvm.ir.assert_structural_equal(after, ComputedMinusLinearExpected)
    assert_same_numerics(ComputedMinusLinear, after)
