"""HorizontalGemm: Linears reading one input become one wide GEMM plus slices."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tests.relax_util import assert_same_numerics
from tvmfuse.passes import HorizontalGemm

RNG = np.random.default_rng(0)
WQ, WK, WV = (RNG.standard_normal((16, n)).astype("float32") for n in (16, 8, 8))
BQ, BV = (RNG.standard_normal(n).astype("float32") for n in (16, 8))


def _qkv() -> tvm.IRModule:
    """q = x·Wq + bq, k = x·Wk (no bias), v = x·Wv + bv; out = q·(k|v)ᵀ-ish use of all three."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            q = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(WQ))), relax.const(BQ)))
            k = bb.emit(relax.op.matmul(x, relax.const(WK)))
            v = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(WV))), relax.const(BV)))
            kv = bb.emit(relax.op.concat([k, v], axis=1))
            out = bb.emit_output(relax.op.multiply(q, kv))
        bb.emit_func_output(out)
    return bb.get()


def _qkv_expected() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    w = np.concatenate([WQ, WK, WV], axis=1)
    b = np.concatenate([BQ, np.zeros(8, "float32"), BV])
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), relax.const(b)))
            q = bb.emit(relax.op.strided_slice(y, [1], [0], [16]))
            k = bb.emit(relax.op.strided_slice(y, [1], [16], [24]))
            v = bb.emit(relax.op.strided_slice(y, [1], [24], [32]))
            kv = bb.emit(relax.op.concat([k, v], axis=1))
            out = bb.emit_output(relax.op.multiply(q, kv))
        bb.emit_func_output(out)
    return bb.get()


@I.ir_module
class DifferentInputs:
    @R.function
    def main(x: R.Tensor((4, 16), "float32"), z: R.Tensor((4, 16), "float32"),
             w: R.Tensor((16, 16), "float32")) -> R.Tensor((4, 16), "float32"):
        with R.dataflow():
            a = R.matmul(x, w)
            b = R.matmul(z, w)
            y = R.add(a, b)
            R.output(y)
        return y


def test_qkv_projections_become_one_gemm():
    before = _qkv()
    after = HorizontalGemm()(before)
    tvm.ir.assert_structural_equal(after, _qkv_expected())
    assert_same_numerics(before, after)


def test_input_module_is_not_modified():
    """The pass returns a new module; the caller's (kept by the report per stage) is unchanged."""
    before = _qkv()
    HorizontalGemm()(before)
    tvm.ir.assert_structural_equal(before, _qkv())


def test_non_constant_weights_or_other_inputs_left_alone():
    after = HorizontalGemm()(DifferentInputs)
    tvm.ir.assert_structural_equal(after, DifferentInputs)


def _swiglu() -> tvm.IRModule:
    """silu(x·Wg)·(x·Wu) with a third Linear on x: only the pair that meets is kept apart."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            gate = bb.emit(relax.op.matmul(x, relax.const(WK)))
            up = bb.emit(relax.op.matmul(x, relax.const(WV)))
            h = bb.emit(relax.op.multiply(bb.emit(relax.op.nn.silu(gate)), up))
            out = bb.emit_output(relax.op.add(h, h))
        bb.emit_func_output(out)
    return bb.get()


def test_outputs_meeting_in_an_epilogue_stay_separate():
    """SwiGLU's gate and up GEMMs already make one epilogue; a wide GEMM would add a kernel."""
    before = _swiglu()
    tvm.ir.assert_structural_equal(HorizontalGemm()(before), before)


def _attention_on(bb: relax.BlockBuilder, x: relax.Var) -> relax.Expr:
    """``attention(q, k, v)`` with Q, K, V each only a projection of x reshaped to 4-D."""
    qkv = [bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(x, relax.const(w))), (1, 4, 2, 4)))
           for w in (WK, WV, WK)]
    return relax.op.nn.attention(*qkv)


def _bert_like() -> tvm.IRModule:
    """Q, K, V each only reshaped into the attention call (their slices are packed for it later
    by PackAttentionInputs, so merging them saves two GEMM launches)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(_attention_on(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def _matmuls(mod: tvm.IRModule) -> int:
    return mod.script().count("R.matmul(")


def test_projections_feeding_only_the_attention_call_merge():
    before = _bert_like()
    after = HorizontalGemm()(before)
    assert _matmuls(before) == 3 and _matmuls(after) == 1
    assert after.script().count("R.strided_slice(") == 3
    assert_same_numerics(before, after)


def _parallel_mlp() -> tvm.IRModule:
    """GPT-J / GPT-NeoX's parallel block: Q, K, V into the attention, and the MLP's fc_in on the
    same x with its bias and GELU (through a reshape, as the 3-D MLP is written)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            attn = bb.emit(relax.op.reshape(_attention_on(bb, x), (4, 8)))
            fc = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(WQ))), relax.const(BQ)))
            act = bb.emit(relax.op.nn.gelu(bb.emit(relax.op.reshape(fc, (1, 4, 16)))))
            out = bb.emit_output(relax.op.add(relax.op.reshape(act, (4, 16)),
                                              relax.op.concat([attn, attn], axis=1)))
        bb.emit_func_output(out)
    return bb.get()


def test_a_projection_with_its_own_activation_keeps_its_gemm():
    """fc_in's GELU goes into fc_in's own GEMM epilogue; merged with Q/K/V it was a slice + bias +
    GELU kernel of its own and a round trip of the MLP width (GPT-J 1024/4096 at 1024 tokens:
    the report's fused bytes 330 → 184 MB, same kernel count). Q, K and V still merge. (Outputs
    meeting after reshapes count as meeting too: Cohere's parallel SwiGLU now becomes a pair GEMM
    instead of riding in the QKV GEMM.)"""
    before = _parallel_mlp()
    after = HorizontalGemm()(before)
    assert _matmuls(before) == 4 and _matmuls(after) == 2
    assert after.script().count("R.strided_slice(") == 3
    assert_same_numerics(before, after)


def _half_biased_projections() -> tvm.IRModule:
    """torch's fp16 Linear as tvmfuse imports it: ``astype(matmul(x, W, fp32) + astype(b, fp32),
    fp16)``, three of them on one x, each only reshaped into the attention call (BERT's Q/K/V)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            qkv = []
            for w, b in ((WQ[:, :8], BV), (WK, BV[::-1].copy()), (WV, BQ[:8])):
                y = bb.emit(relax.op.matmul(x, relax.const(w.astype("float16")), out_dtype="float32"))
                bias = bb.emit(relax.op.astype(relax.const(b.astype("float16")), "float32"))
                y16 = bb.emit(relax.op.astype(bb.emit(relax.op.add(y, bias)), "float16"))
                qkv.append(bb.emit(relax.op.reshape(y16, (1, 4, 2, 4))))
            out = bb.emit_output(relax.op.nn.attention(*qkv))
        bb.emit_func_output(out)
    return bb.get()


def test_biases_cast_to_the_accumulator_merge_into_the_wide_gemm():
    """The biases (fp16 constants cast to fp32) concatenate into one add after the wide GEMM, so
    its epilogue takes bias + cast and the GEMM writes fp16. Left per slice (before session 24),
    the wide GEMM had no epilogue and the sm90 rule refused it (``no epilogue block``: BERT's QKV
    GEMM from torch ran on the sm80 path and wrote fp32)."""
    before = _half_biased_projections()
    after = HorizontalGemm()(before)
    assert _matmuls(before) == 3 and _matmuls(after) == 1
    bindings = [b.value for b in after["main"].body.blocks[0].bindings]
    adds = [v for v in bindings if getattr(v, "op", None) == tvm.ir.Op.get("relax.add")]
    assert len(adds) == 1 and adds[0].args[1].ty.shape[0] == 24, after.script()
    assert_same_numerics(before, after, rtol=1e-3)
