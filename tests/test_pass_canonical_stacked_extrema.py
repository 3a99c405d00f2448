"""StackedExtrema: ONNX Max / Min as TVM imports them (broadcast, stack, reduce) → one
elementwise ``maximum`` / ``minimum`` (XGLM's clamp before the softmax, exported to ONNX)."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.canonical_util import apply
from tests.relax_util import assert_same_numerics
from tvmfuse.passes.canonical import StackedExtrema


@I.ir_module
class Before:
    """``Max(s, -65504)`` then ``Min(s, a, b)`` with ``a`` (4, 8) and ``b`` (8,) broadcast."""

    @R.function
    def main(s: R.Tensor((2, 4, 8), "float16"), a: R.Tensor((4, 8), "float16"),
             b: R.Tensor((8,), "float16")) -> R.Tensor((2, 4, 8), "float16"):
        with R.dataflow():
            s1 = R.broadcast_to(s, R.shape([2, 4, 8]))
            c1 = R.broadcast_to(R.const(-65504.0, "float16"), R.shape([2, 4, 8]))
            st = R.stack((s1, c1), axis=0)
            mx = R.max(st, axis=[0], keepdims=False)
            a1 = R.broadcast_to(a, R.shape([2, 4, 8]))
            b1 = R.broadcast_to(b, R.shape([2, 4, 8]))
            st2 = R.stack((mx, a1, b1), axis=-1)
            mn = R.min(st2, axis=[3], keepdims=False)
            R.output(mn)
        return mn


@I.ir_module
class Expected:
    @R.function
    def main(s: R.Tensor((2, 4, 8), "float16"), a: R.Tensor((4, 8), "float16"),
             b: R.Tensor((8,), "float16")) -> R.Tensor((2, 4, 8), "float16"):
        with R.dataflow():
            mx = R.maximum(s, R.const(-65504.0, "float16"))
            m1 = R.minimum(mx, a)
            mn = R.minimum(m1, b)
            R.output(mn)
        return mn


@I.ir_module
class NotAnExtremum:
    """A max over another axis than the stacked one, and one that keeps the axis."""

    @R.function
    def main(s: R.Tensor((2, 4), "float32"), t: R.Tensor((2, 4), "float32")):
        with R.dataflow():
            st = R.stack((s, t), axis=0)
            a = R.max(st, axis=[1], keepdims=False)
            b = R.max(st, axis=[0], keepdims=True)
            R.output(a, b)
        return (a, b)


def test_stacked_max_and_min():
    after = apply(StackedExtrema(), Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert_same_numerics(Before, after)


def test_other_reductions_left_alone():
    tvm.ir.assert_structural_equal(apply(StackedExtrema(), NotAnExtremum), NotAnExtremum)
