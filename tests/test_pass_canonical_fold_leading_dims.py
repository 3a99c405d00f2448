"""FoldMatmulLeadingDims: (…, M, K)·(K, N) → 2-D GEMM between reshapes, bias/cast epilogue inside."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tests.canonical_util import apply
from tests.relax_util import assert_same_numerics
from tvmfuse.passes.canonical import FoldMatmulLeadingDims


@I.ir_module
class Before:
    """The ONNX spelling of ``x + Linear(x)`` in fp16: MatMul on 3-D, then Add(bias, ·)."""

    @R.function
    def main(x: R.Tensor((2, 8, 64), "float16"), w: R.Tensor((64, 64), "float16"),
             b: R.Tensor((64,), "float16")):
        with R.dataflow():
            acc = R.matmul(x, w, out_dtype="float32")
            y = R.astype(acc, "float16")
            z = R.add(b, y)
            out = R.add(x, z)
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((2, 8, 64), "float16"), w: R.Tensor((64, 64), "float16"),
             b: R.Tensor((64,), "float16")):
        with R.dataflow():
            x2 = R.reshape(x, R.shape([16, 64]))
            acc = R.matmul(x2, w, out_dtype="float32")
            y = R.astype(acc, "float16")
            z2 = R.add(y, b)
            z = R.reshape(z2, R.shape([2, 8, 64]))
            out = R.add(x, z)
            R.output(out)
        return out


@I.ir_module
class Shared:
    """The product has a second user: only the matmul folds, the bias add stays outside."""

    @R.function
    def main(x: R.Tensor((2, 8, 64), "float32"), w: R.Tensor((64, 32), "float32"),
             b: R.Tensor((32,), "float32")):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            z = R.add(y, b)
            out = R.multiply(z, y)
            R.output(out)
        return out


@I.ir_module
class SharedExpected:
    @R.function
    def main(x: R.Tensor((2, 8, 64), "float32"), w: R.Tensor((64, 32), "float32"),
             b: R.Tensor((32,), "float32")):
        with R.dataflow():
            x2 = R.reshape(x, R.shape([16, 64]))
            y2 = R.matmul(x2, w, out_dtype="float32")
            y = R.reshape(y2, R.shape([2, 8, 32]))
            z = R.add(y, b)
            out = R.multiply(z, y)
            R.output(out)
        return out


@I.ir_module
class Symbolic:
    """A dynamic batch (ONNX ``--dynamic-batch``): M = batch · 8."""

    @R.function
    def main(x: R.Tensor(("n", 8, 64), "float32"), w: R.Tensor((64, 32), "float32")):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            R.output(y)
        return y


@I.ir_module
class SymbolicExpected:
    @R.function
    def main(x: R.Tensor(("n", 8, 64), "float32"), w: R.Tensor((64, 32), "float32")):
        n = T.int64()
        with R.dataflow():
            x2 = R.reshape(x, R.shape([n * 8, 64]))
            y2 = R.matmul(x2, w, out_dtype="float32")
            y = R.reshape(y2, R.shape([n, 8, 32]))
            R.output(y)
        return y


@I.ir_module
class Gemm2d:
    @R.function
    def main(x: R.Tensor((16, 64), "float32"), w: R.Tensor((64, 32), "float32")):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            R.output(y)
        return y


def test_onnx_linear_becomes_torch_form():
    tvm.ir.assert_structural_equal(apply(FoldMatmulLeadingDims(), Before), Expected)


def test_shared_product_keeps_its_consumers():
    tvm.ir.assert_structural_equal(apply(FoldMatmulLeadingDims(), Shared), SharedExpected)


def test_symbolic_leading_dim():
    tvm.ir.assert_structural_equal(apply(FoldMatmulLeadingDims(), Symbolic), SymbolicExpected)


def test_2d_gemm_left_alone():
    tvm.ir.assert_structural_equal(apply(FoldMatmulLeadingDims(), Gemm2d), Gemm2d)


def test_numerics():
    assert_same_numerics(Before, apply(FoldMatmulLeadingDims(), Before), rtol=1e-3)
    assert_same_numerics(Shared, apply(FoldMatmulLeadingDims(), Shared), rtol=1e-5)
