"""UnwrapSingleOutput: ``main`` returning ``(y,)`` returns ``y``; several outputs stay a tuple."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.relax_util import apply_pass
from tvmfuse.passes.unwrap_output import UnwrapSingleOutput


@I.ir_module
class OneOutput:
    @R.function
    def main(x: R.Tensor((2, 3), "float32")) -> R.Tuple(R.Tensor((2, 3), "float32")):
        with R.dataflow():
            y = R.nn.relu(x)
            gv = (y,)
            R.output(gv)
        return gv


@I.ir_module
class OneOutputExpected:
    @R.function
    def main(x: R.Tensor((2, 3), "float32")) -> R.Tensor((2, 3), "float32"):
        with R.dataflow():
            y = R.nn.relu(x)
            gv = (y,)
            R.output(gv)
        out = gv[0]
        return out


@I.ir_module
class TwoOutputs:
    @R.function
    def main(x: R.Tensor((2, 3), "float32")) -> R.Tuple(R.Tensor((2, 3), "float32"),
                                                        R.Tensor((2, 3), "float32")):
        with R.dataflow():
            y = R.nn.relu(x)
            gv = (y, x)
            R.output(gv)
        return gv


def test_one_output_is_unwrapped():
    tvm.ir.assert_structural_equal(apply_pass(UnwrapSingleOutput(), OneOutput), OneOutputExpected)


def test_two_outputs_stay_a_tuple():
    tvm.ir.assert_structural_equal(apply_pass(UnwrapSingleOutput(), TwoOutputs), TwoOutputs)
