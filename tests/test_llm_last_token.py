"""LastTokenLogits (tvmfuse/llm/last_token.py): an entry point returns each sequence's last logits
(B, V): ``logits[b, last[b]]`` with a new ``last`` parameter for S > 1, ``logits[:, 0]`` for S = 1.
The new bindings join the function's dataflow block, where the reshapes become views (after it,
each was a copy kernel: three per decode step)."""

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
    def main(x: R.Tensor((2, 8, 16), "float32"),
             last: R.Tensor((2,), "int32")) -> R.Tensor((2, 16), "float32"):
        with R.dataflow():
            y = R.multiply(x, R.const(2.0, "float32"))
            out = (y,)
            logits = out[0]
            row_starts = R.arange(R.prim_value(0), R.prim_value(16), R.prim_value(8), dtype="int32")
            last_rows = R.add(row_starts, last)
            flat_logits = R.reshape(logits, R.shape([16, 16]))
            last_logits = R.take(flat_logits, last_rows, axis=0, mode="clip")
            R.output(out, last_logits)
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
    def main(x: R.Tensor((3, 5, 7), "float32"),
             last: R.Tensor((3,), "int32")) -> R.Tensor((3, 7), "float32"):
        with R.dataflow():
            y = R.add(x, x)
            row_starts = R.arange(R.prim_value(0), R.prim_value(15), R.prim_value(5), dtype="int32")
            last_rows = R.add(row_starts, last)
            flat_logits = R.reshape(y, R.shape([15, 7]))
            last_logits = R.take(flat_logits, last_rows, axis=0, mode="clip")
            R.output(y, last_logits)
        return last_logits


@I.ir_module
class Decode:
    @R.function
    def main(x: R.Tensor((3, 1, 7), "float32")) -> R.Tensor((3, 1, 7), "float32"):
        with R.dataflow():
            y = R.add(x, x)
            R.output(y)
        return y


@I.ir_module
class DecodeExpected:
    @R.function
    def main(x: R.Tensor((3, 1, 7), "float32")) -> R.Tensor((3, 7), "float32"):
        with R.dataflow():
            y = R.add(x, x)
            last_logits = R.reshape(y, R.shape([3, 7]))
            R.output(y, last_logits)
        return last_logits


@pytest.mark.parametrize("before, expected", [(OneTuple, OneTupleExpected), (Bare, BareExpected)])
def test_structure_and_numerics(before, expected):
    """Right-padded rows: row b's logits at its own last position (here 7 − b, or 4 − b)."""
    after = apply_pass(LastTokenLogits(), before)
    tvm.ir.assert_structural_equal(after, expected)
    x = random_inputs(before)[0]
    ref = run_llvm(Bare, x) if before is Bare else 2 * x
    b, s = x.shape[:2]
    last = (s - 1 - np.arange(b)).astype("int32")
    np.testing.assert_array_equal(run_llvm(after, x, last), ref[np.arange(b), last])


def test_decode_takes_its_one_position():
    after = apply_pass(LastTokenLogits(), Decode)
    tvm.ir.assert_structural_equal(after, DecodeExpected)
    x = random_inputs(Decode)[0]
    np.testing.assert_array_equal(run_llvm(after, x), 2 * x[:, 0])


@I.ir_module
class NotLogits:
    @R.function
    def main(x: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8), "float32"):
        return x


def test_refuses_a_result_that_is_not_batch_seq_vocab():
    with pytest.raises(CompileError, match=r"main returns .*expected logits \(batch, seq, vocab\)"):
        apply_pass(LastTokenLogits(), NotLogits)
