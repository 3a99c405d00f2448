"""LastTokenLogits (tvmfuse/llm/last_token.py): an entry point returns logits[:, S - 1] (B, V)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.relax_util import apply_pass, random_inputs, run_llvm
from tvmfuse.errors import CompileError
from tvmfuse.llm.last_token import LastTokenLogits


@I.ir_module
class OneTuple:
    @R.function
    def main(x: R.Tensor((2, 8, 16), "float32")) -> R.Tuple(R.Tensor((2, 8, 16), "float32")):
        with R.dataflow():
            y = R.multiply(x, R.const(2.0, "float32"))
            out = (y,)
            R.output(out)
        return out


@I.ir_module
class OneTupleExpected:
    @R.function
    def main(x: R.Tensor((2, 8, 16), "float32")) -> R.Tensor((2, 16), "float32"):
        with R.dataflow():
            y = R.multiply(x, R.const(2.0, "float32"))
            out = (y,)
            R.output(out)
        logits = out[0]
        last_position = R.strided_slice(logits, axes=[1], begin=[7], end=[8])
        last_logits = R.reshape(last_position, R.shape([2, 16]))
        return last_logits


@I.ir_module
class Bare:
    @R.function
    def main(x: R.Tensor((3, 5, 7), "float32")) -> R.Tensor((3, 5, 7), "float32"):
        with R.dataflow():
            y = R.add(x, x)
            R.output(y)
        return y


@I.ir_module
class BareExpected:
    @R.function
    def main(x: R.Tensor((3, 5, 7), "float32")) -> R.Tensor((3, 7), "float32"):
        with R.dataflow():
            y = R.add(x, x)
            R.output(y)
        last_position = R.strided_slice(y, axes=[1], begin=[4], end=[5])
        last_logits = R.reshape(last_position, R.shape([3, 7]))
        return last_logits


@pytest.mark.parametrize("before, expected", [(OneTuple, OneTupleExpected), (Bare, BareExpected)])
def test_structure_and_numerics(before, expected):
    after = apply_pass(LastTokenLogits(), before)
    tvm.ir.assert_structural_equal(after, expected)
    x = random_inputs(before)[0]
    ref = run_llvm(Bare, x) if before is Bare else 2 * x
    np.testing.assert_array_equal(run_llvm(after, x), ref[:, -1])


@I.ir_module
class NotLogits:
    @R.function
    def main(x: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8), "float32"):
        return x


def test_refuses_a_result_that_is_not_batch_seq_vocab():
    with pytest.raises(CompileError, match=r"main returns .*expected logits \(batch, seq, vocab\)"):
        apply_pass(LastTokenLogits(), NotLogits)
