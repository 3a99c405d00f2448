"""TupleOutput: an ONNX one-output ``main`` returns a 1-tuple, as torch.export's import does."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.canonical_util import apply
from tests.relax_util import random_inputs, run_llvm
from tvmfuse.passes.canonical import TupleOutput


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((16, 64), "float32")) -> R.Tensor((2, 8, 64), "float32"):
        with R.dataflow():
            y = R.add(x, x)
            gv = R.reshape(y, R.shape([2, 8, 64]))
            R.output(gv)
        return gv


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((16, 64), "float32")) -> R.Tuple(R.Tensor((2, 8, 64), "float32")):
        with R.dataflow():
            y = R.add(x, x)
            lv = R.reshape(y, R.shape([2, 8, 64]))
            gv = (lv,)
            R.output(gv)
        return gv


def test_single_output_wrapped():
    tvm.ir.assert_structural_equal(apply(TupleOutput(), Before), Expected)


def test_tuple_output_left_alone():
    tvm.ir.assert_structural_equal(apply(TupleOutput(), Expected), Expected)


def test_numerics():
    x = random_inputs(Before)[0]
    from tvmfuse.passes.unwrap_output import UnwrapSingleOutput

    after = UnwrapSingleOutput()(apply(TupleOutput(), Before))
    assert (run_llvm(after, x) == run_llvm(Before, x)).all()
