"""HalfMatmulAccumulate: GEMMs without an fp32 accumulator get one (the ONNX importer's MatMul)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.canonical_util import apply, errors_vs_float64
from tvmfuse.passes.canonical import HalfMatmulAccumulate


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((2, 16, 512), "float16"), w: R.Tensor((512, 64), "float16")):
        with R.dataflow():
            y = R.matmul(x, w)
            R.output(y)
        return y


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((2, 16, 512), "float16"), w: R.Tensor((512, 64), "float16")):
        with R.dataflow():
            acc = R.matmul(x, w, out_dtype="float32")
            y = R.astype(acc, "float16")
            R.output(y)
        return y


@I.ir_module
class Fp32:
    @R.function
    def main(x: R.Tensor((16, 32), "float32"), w: R.Tensor((32, 8), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            R.output(y)
        return y


@I.ir_module
class Fp32Expected:
    @R.function
    def main(x: R.Tensor((16, 32), "float32"), w: R.Tensor((32, 8), "float32")):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            R.output(y)
        return y


@I.ir_module
class Batched:
    """Both operands 3-D (attention's products): not a GEMM here, left to FuseAttention."""

    @R.function
    def main(q: R.Tensor((4, 16, 32), "float16"), k: R.Tensor((4, 32, 16), "float16")):
        with R.dataflow():
            s = R.matmul(q, k)
            R.output(s)
        return s


def test_half_gemm_accumulates_in_fp32():
    tvm.ir.assert_structural_equal(apply(HalfMatmulAccumulate(), Before), Expected)


def test_fp32_gemm_names_its_accumulator():
    tvm.ir.assert_structural_equal(apply(HalfMatmulAccumulate(), Fp32), Fp32Expected)


def test_batched_and_already_fp32_left_alone():
    tvm.ir.assert_structural_equal(apply(HalfMatmulAccumulate(), Batched), Batched)
    tvm.ir.assert_structural_equal(apply(HalfMatmulAccumulate(), Expected), Expected)


def test_numerics_closer_to_float64():
    """K = 512: the fp16 accumulator of Before loses digits; After rounds once, at the end."""
    before, after = errors_vs_float64(Before, apply(HalfMatmulAccumulate(), Before), np.matmul)
    assert after <= 1e-3, after
    assert after < before, (before, after)
