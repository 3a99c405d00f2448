"""MatmulRanks: a batched product of a 4-D and a 3-D operand (dynamo's ONNX export of a
heads-folded attention at batch 1) → both 4-D, the 3-D one viewed with a leading unit axis."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.canonical_util import apply
from tests.relax_util import assert_same_numerics
from tvmfuse.passes.canonical import MatmulRanks


@I.ir_module
class Before:
    @R.function
    def main(q: R.Tensor((1, 2, 8, 16), "float16"), kt: R.Tensor((2, 16, 8), "float16")
             ) -> R.Tensor((1, 2, 8, 8), "float32"):
        with R.dataflow():
            s = R.matmul(q, kt, out_dtype="float32")
            R.output(s)
        return s


@I.ir_module
class Expected:
    @R.function
    def main(q: R.Tensor((1, 2, 8, 16), "float16"), kt: R.Tensor((2, 16, 8), "float16")
             ) -> R.Tensor((1, 2, 8, 8), "float32"):
        with R.dataflow():
            k4 = R.reshape(kt, R.shape([1, 2, 16, 8]))
            s = R.matmul(q, k4, out_dtype="float32")
            R.output(s)
        return s


@I.ir_module
class Linear:
    """An N-D × 2-D product (a Linear), and two operands of one rank: left alone."""

    @R.function
    def main(q: R.Tensor((1, 2, 8, 16), "float16"), w: R.Tensor((16, 4), "float16"),
             k: R.Tensor((1, 2, 16, 8), "float16")):
        with R.dataflow():
            y = R.matmul(q, w)
            s = R.matmul(q, k)
            R.output(y, s)
        return (y, s)


def test_lower_rank_operand_gets_unit_axes():
    after = apply(MatmulRanks(), Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert_same_numerics(Before, after, rtol=1e-3)


def test_linear_and_equal_ranks_left_alone():
    tvm.ir.assert_structural_equal(apply(MatmulRanks(), Linear), Linear)
