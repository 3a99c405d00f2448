"""SimplifyNoOps: same-dtype casts, x*1 and x+0 disappear."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.relax_util import apply_pass
from tvmfuse.passes import SimplifyNoOps


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float16"):
        with R.dataflow():
            a = R.astype(x, "float32")
            b = R.multiply(a, R.const(1.0, "float32"))
            c = R.add(R.const(0.0, "float32"), b)
            d = R.astype(c, "float16")
            R.output(d)
        return d


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float16"):
        with R.dataflow():
            d = R.astype(x, "float16")
            R.output(d)
        return d


@I.ir_module
class Broadcasting:
    """x * ones((4, 8)) with x: (8,) broadcasts: the result shape differs, keep it."""

    @R.function
    def main(x: R.Tensor((8,), "float32")) -> R.Tensor((2, 8), "float32"):
        with R.dataflow():
            y = R.multiply(x, R.const(2.0, "float32"))
            z = R.add(y, R.const(1.0, "float32"))
            w = R.broadcast_to(z, R.shape([2, 8]))
            R.output(w)
        return w


def test_noops_removed():
    tvm.ir.assert_structural_equal(apply_pass(SimplifyNoOps(), Before), Expected)


def test_real_ops_kept():
    tvm.ir.assert_structural_equal(apply_pass(SimplifyNoOps(), Broadcasting), Broadcasting)
