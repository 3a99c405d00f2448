"""UnitKMatmul: a matmul over a contraction of length 1 (an outer product) → a broadcast multiply.

On the H200 such products fused with their ``+ S`` consumer came out ``2·S + kᵀ·v`` (the GPU
schedule rules inlined the add into the reduction's init and update); as a multiply no reduction
is left to get wrong."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.canonical_util import apply
from tests.relax_util import assert_same_numerics
from tvmfuse.passes.unit_k_matmul import UnitKMatmul
from tvmfuse.rules import Elementwise


@I.ir_module
class Before:
    """The state update of a linear-attention step: S + kᵀ·v, k (2, 4, 8, 1), v (2, 4, 1, 8)."""

    @R.function
    def main(k: R.Tensor((2, 4, 8, 1), "float16"), v: R.Tensor((2, 4, 1, 8), "float16"),
             s: R.Tensor((2, 4, 8, 8), "float32")):
        with R.dataflow():
            kv = R.matmul(k, v, out_dtype="float32")
            y = R.add(s, kv)
            R.output(y)
        return y


@I.ir_module
class Expected:
    @R.function
    def main(k: R.Tensor((2, 4, 8, 1), "float16"), v: R.Tensor((2, 4, 1, 8), "float16"),
             s: R.Tensor((2, 4, 8, 8), "float32")):
        with R.dataflow():
            kf = R.astype(k, "float32")
            vf = R.astype(v, "float32")
            kv = R.multiply(kf, vf)
            y = R.add(s, kv)
            R.output(y)
        return y


@I.ir_module
class RealGemm:
    """K = 8: a product, left alone."""

    @R.function
    def main(q: R.Tensor((2, 4, 1, 8), "float32"), s: R.Tensor((2, 4, 8, 8), "float32")):
        with R.dataflow():
            y = R.matmul(q, s, out_dtype="float32")
            R.output(y)
        return y


def test_outer_product_becomes_multiply():
    after = apply(UnitKMatmul(), Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert_same_numerics(Before, after)


def test_products_over_longer_contractions_stay():
    tvm.ir.assert_structural_equal(apply(UnitKMatmul(), RealGemm), RealGemm)


def test_elementwise_rule_refuses_unit_reductions():
    """The lowered K = 1 product is a reduction whose reduce axis has extent 1: dlight's
    normalisation reads it as spatial, and the Elementwise rule must still not take it."""
    mod = tvm.relax.transform.LegalizeOps()(Before)
    func = next(f for gv, f in mod.functions_items() if gv.name_hint == "matmul")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host={"kind": "llvm"})
    assert Elementwise().apply(func, target, False) is None
