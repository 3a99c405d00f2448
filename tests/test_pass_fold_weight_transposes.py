"""FoldWeightTransposes: ``permute_dims`` of a large 2-D weight constant becomes the transposed
constant (torch does the transpose once per weight); small or other permutes stay for FoldConstant."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tests.canonical_util import apply
from tvmfuse.passes.fold_weight_transposes import FoldWeightTransposes

K, N = 512, 1024  # fp16: 1 MiB, the smallest weight the pass takes


def _linear(w: np.ndarray, names=("main",), m: int = 4, axes=None) -> tvm.IRModule:
    """``x @ permute_dims(W)`` per function of ``names``, all on the same constant W (N, K)."""
    bb = relax.BlockBuilder()
    const = relax.const(w)
    for name in names:
        x = relax.Var("x", relax.TensorType((m, w.shape[1]), str(w.dtype)))
        with bb.function(name, [x]):
            with bb.dataflow():
                wt = bb.emit(relax.op.permute_dims(const, axes))
                out = bb.emit_output(relax.op.matmul(x, wt))
            bb.emit_func_output(out)
    return bb.get()


def _expected(wt: np.ndarray, names=("main",), m: int = 4) -> tvm.IRModule:
    """The binding keeps its var, now bound to the constant (as after FoldConstant)."""
    bb = relax.BlockBuilder()
    const = relax.const(wt)
    for name in names:
        x = relax.Var("x", relax.TensorType((m, wt.shape[0]), str(wt.dtype)))
        with bb.function(name, [x]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.matmul(x, bb.emit(const)))
            bb.emit_func_output(out)
    return bb.get()


def _weight(n: int = N, k: int = K, dtype: str = "float16") -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((n, k)) / k ** 0.5).astype(dtype)


def test_weight_transpose_becomes_a_constant():
    w = _weight()
    after = apply(FoldWeightTransposes(), _linear(w))
    tvm.ir.assert_structural_equal(after, _expected(np.ascontiguousarray(w.T)))


def test_explicit_axes_and_fp32():
    w = _weight(256, 1024, "float32")  # 1 MiB in fp32
    after = apply(FoldWeightTransposes(), _linear(w, axes=[1, 0]))
    tvm.ir.assert_structural_equal(after, _expected(np.ascontiguousarray(w.T)))


def test_one_transpose_per_weight_across_functions():
    """Prefill and decode entry points multiply by the same W: one transposed constant for both."""
    w = _weight()
    after = apply(FoldWeightTransposes(), _linear(w, names=("prefill", "decode")))
    tvm.ir.assert_structural_equal(after, _expected(np.ascontiguousarray(w.T), names=("prefill", "decode")))
    consts = []
    for name in ("prefill", "decode"):
        relax.analysis.post_order_visit(after[name], lambda e: consts.append(e) if isinstance(
            e, tvm.ir.expr.GenericConst) and len(e.value.shape) == 2 else None)
    assert len(consts) == 2 and consts[0].same_as(consts[1])


def test_small_constant_left_for_fold_constant():
    before = _linear(_weight(64, 64))
    tvm.ir.assert_structural_equal(apply(FoldWeightTransposes(), before), before)


def test_runtime_transpose_left():
    """A transpose of an input is not a weight: left."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, K), "float16"))
    w = relax.Var("w", relax.TensorType((N, K), "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w))))
        bb.emit_func_output(out)
    before = bb.get()
    tvm.ir.assert_structural_equal(apply(FoldWeightTransposes(), before), before)
