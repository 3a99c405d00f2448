"""ShareCasts: torch.export's repeated ``x.float()`` casts become one (as ONNX writes them)."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.canonical_util import apply
from tests.relax_util import assert_same_numerics
from tvmfuse.passes.canonical import ShareCasts


@I.ir_module
class Before:
    """HF's fp16 RMSNorm as torch.export writes it: ``x.float()`` twice."""

    @R.function
    def main(x: R.Tensor((2, 8, 64), "float16"), w: R.Tensor((64,), "float16")):
        with R.dataflow():
            a = R.astype(x, "float32")
            sq = R.power(a, R.const(2.0, "float32"))
            var = R.mean(sq, axis=[-1], keepdims=True)
            b = R.astype(x, "float32")
            inv = R.rsqrt(R.add(var, R.const(1e-6, "float32")))
            normed = R.multiply(b, inv)
            h = R.astype(normed, "float16")
            c = R.astype(x, "bfloat16")  # another dtype: its own cast
            out = R.multiply(h, w)
            R.output(out, c)
        return (out, c)


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((2, 8, 64), "float16"), w: R.Tensor((64,), "float16")):
        with R.dataflow():
            a = R.astype(x, "float32")
            sq = R.power(a, R.const(2.0, "float32"))
            var = R.mean(sq, axis=[-1], keepdims=True)
            inv = R.rsqrt(R.add(var, R.const(1e-6, "float32")))
            normed = R.multiply(a, inv)
            h = R.astype(normed, "float16")
            c = R.astype(x, "bfloat16")
            out = R.multiply(h, w)
            R.output(out, c)
        return (out, c)


@I.ir_module
class Single:
    @R.function
    def main(x: R.Tensor((2, 8, 64), "float16")):
        with R.dataflow():
            a = R.astype(x, "float32")
            b = R.astype(x, "float32")
            out = R.add(a, b)
            R.output(out)
        return out


def test_repeated_cast_shared():
    tvm.ir.assert_structural_equal(apply(ShareCasts(), Before), Expected)


def test_numerics():
    assert_same_numerics(Single, apply(ShareCasts(), Single), rtol=0.0)
    assert "astype" in apply(ShareCasts(), Single).script()
    assert apply(ShareCasts(), Single).script().count("R.astype") == 1
