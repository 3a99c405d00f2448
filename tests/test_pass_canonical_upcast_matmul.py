"""UpcastMatmul: ``x.float() @ w.float()`` of half tensors → the fp32-accumulating half GEMM."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tests.canonical_util import apply, errors_vs_float64
from tests.relax_util import assert_same_numerics
from tvmfuse.passes.canonical import UpcastMatmul


@I.ir_module
class Before:
    """torch.export of ``x.float() @ w.float().T`` (x (2, 8, 64), w (32, 64) fp16), cast back."""

    @R.function
    def main(x: R.Tensor((2, 8, 64), "float16"), w: R.Tensor((32, 64), "float16")):
        with R.dataflow():
            xf = R.astype(x, "float32")
            x2 = R.reshape(xf, R.shape([16, 64]))
            wf = R.astype(w, "float32")
            wt = R.permute_dims(wf, axes=[1, 0])
            y = R.matmul(x2, wt, out_dtype="float32")
            z = R.astype(y, "float16")
            R.output(z)
        return z


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((2, 8, 64), "float16"), w: R.Tensor((32, 64), "float16")):
        with R.dataflow():
            x2 = R.reshape(x, R.shape([16, 64]))
            wt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x2, wt, out_dtype="float32")
            z = R.astype(y, "float16")
            R.output(z)
        return z


@I.ir_module
class MixedHalves:
    """bf16 × fp16 upcasts: no common half dtype, left alone."""

    @R.function
    def main(x: R.Tensor((16, 64), "bfloat16"), w: R.Tensor((64, 32), "float16")):
        with R.dataflow():
            xf = R.astype(x, "float32")
            wf = R.astype(w, "float32")
            y = R.matmul(xf, wf, out_dtype="float32")
            R.output(y)
        return y


def _const_weight_module(weight: np.ndarray) -> tvm.IRModule:
    """``astype(x16, f32) @ W`` with W an fp32 constant (ONNX folds ``w.float()`` this way)."""
    x = relax.Var("x", relax.TensorType((16, 64), "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            xf = bb.emit(relax.op.astype(x, "float32"))
            y = bb.emit_output(relax.op.matmul(xf, relax.const(weight), out_dtype="float32"))
        bb.emit_func_output(y)
    return bb.get()


def _weight(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((64, 32)).astype(np.float32)


def test_upcasts_through_views_become_half_gemm():
    tvm.ir.assert_structural_equal(apply(UpcastMatmul(), Before), Expected)


def test_mixed_half_dtypes_left_alone():
    tvm.ir.assert_structural_equal(apply(UpcastMatmul(), MixedHalves), MixedHalves)


def test_exact_fp32_constant_becomes_half():
    w = _weight().astype(np.float16).astype(np.float32)  # exact in fp16
    after = apply(UpcastMatmul(), _const_weight_module(w))
    x = relax.Var("x", relax.TensorType((16, 64), "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, relax.const(w.astype(np.float16)), out_dtype="float32"))
        bb.emit_func_output(y)
    tvm.ir.assert_structural_equal(after, bb.get())


def test_inexact_fp32_constant_left_alone():
    mod = _const_weight_module(_weight())  # fp32 values that fp16 would round
    tvm.ir.assert_structural_equal(apply(UpcastMatmul(), mod), mod)


def test_numerics_same_as_upcast_form():
    """Half products are exact in fp32: Before and After agree to fp32 summation order."""
    assert_same_numerics(Before, apply(UpcastMatmul(), Before), rtol=1e-3)
    w = _weight(1).astype(np.float16).astype(np.float32)
    mod = _const_weight_module(w)
    before, after = errors_vs_float64(mod, apply(UpcastMatmul(), mod), lambda x: x @ w)
    assert after <= 1e-6 and before <= 1e-6, (before, after)
