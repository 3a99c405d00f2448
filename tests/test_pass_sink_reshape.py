"""SinkReshape: a reshape between a GEMM and its epilogue moves below the epilogue."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.relax_util import assert_same_numerics
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


def test_linear_epilogue_and_residual():
    after = SinkReshape()(LinearResidual)
    after = tvm.relax.transform.CanonicalizeBindings()(after)
    tvm.ir.assert_structural_equal(after, LinearResidualExpected)
    assert_same_numerics(LinearResidual, after)


def test_regrouped_last_axis_is_left_alone():
    after = SinkReshape()(ReshapeChangesLastAxis)
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
