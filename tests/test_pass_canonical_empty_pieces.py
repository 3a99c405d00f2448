"""EmptyPieces: a split piece or concat operand of static size 0 leaves the graph (ONNX
RotaryEmbedding's pass-through part when the whole head rotates)."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.canonical_util import apply
from tests.relax_util import assert_same_numerics
from tvmfuse.passes.canonical import EmptyPieces


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((2, 3, 8), "float32")):
        with R.dataflow():
            parts = R.split(x, indices_or_sections=[8], axis=-1)
            rot = parts[0]
            keep = parts[1]
            y = R.multiply(rot, R.const(2.0, "float32"))
            z = R.concat((y, keep), axis=-1)
            out = R.add(z, R.const(1.0, "float32"))
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((2, 3, 8), "float32")):
        with R.dataflow():
            rot = R.strided_slice(x, axes=[2], begin=[0], end=[8])
            y = R.multiply(rot, R.const(2.0, "float32"))
            out = R.add(y, R.const(1.0, "float32"))
            R.output(out)
        return out


@I.ir_module
class NotEmpty:
    @R.function
    def main(x: R.Tensor((2, 3, 8), "float32")):
        with R.dataflow():
            parts = R.split(x, indices_or_sections=[4], axis=-1)
            a = parts[0]
            b = parts[1]
            z = R.concat((b, a), axis=-1)
            R.output(z)
        return z


def test_empty_piece_and_operand_dropped():
    tvm.ir.assert_structural_equal(apply(EmptyPieces(), Before), Expected)


def test_non_empty_split_unchanged():
    tvm.ir.assert_structural_equal(apply(EmptyPieces(), NotEmpty), NotEmpty)


def test_numerics():
    assert_same_numerics(Before, apply(EmptyPieces(), Before), rtol=0.0)
