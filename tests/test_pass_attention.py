"""FuseAttention: spelled-out attention → one ``R.nn.attention`` (tvmfuse/passes/attention.py).

Before/Expected pairs for the basic pattern and every mask / layout / GQA variant, one negative test
per "cannot prove" case (graph unchanged, reason recorded), numerics of each rewrite on llvm (the
rewritten module lowers through tvmfuse's attention legalisation to the CPU kernel).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I  # noqa: E741
from tvm.script import relax as R
from tvm.script import tirx as T

from tests.ir_checks import sxs_tensors
from tests.relax_util import apply_pass, run_llvm
from tvmfuse.passes.attention import FuseAttention, attention_decisions

B, S, H, KVH, D = 2, 8, 4, 2, 16
MIN = -3.4028234663852886e38  # finfo(float32).min, what HF writes for masked scores


def fuse(mod: tvm.IRModule) -> tvm.IRModule:
    return apply_pass(FuseAttention(), mod)


def decisions(mod: tvm.IRModule) -> list[dict[str, str]]:
    return attention_decisions(mod)


def assert_fused(before: tvm.IRModule, expected: tvm.IRModule, **info: str) -> tvm.IRModule:
    after = fuse(before)
    tvm.ir.assert_structural_equal(after.without_attr("tvmfuse.attention_decisions"), expected)
    (d,) = decisions(after)
    assert d["status"] == "fused", d
    for key, value in info.items():
        assert d[key] == value, (key, d)
    return after


def assert_left(before: tvm.IRModule, reason: str) -> None:
    after = fuse(before)
    tvm.ir.assert_structural_equal(after.without_attr("tvmfuse.attention_decisions"), before)
    (d,) = decisions(after)
    assert d["status"] == "left" and reason in d["reason"], d


def inputs_for(mod: tvm.IRModule, seed: int = 0) -> list[np.ndarray]:
    """Random normal floats; int64 inputs become a padding mask (row b keeps S - 2b keys)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for p in mod["main"].params:
        shape, dtype = [int(d) for d in p.ty.shape.values], str(p.ty.dtype)
        if dtype == "int64":
            mask = np.ones(shape, np.int64)
            for b in range(shape[0]):
                mask[b, shape[-1] - 2 * b:] = 0 if b else 1
            arrays.append(mask)
        else:
            arrays.append(rng.standard_normal(shape).astype(dtype))
    return arrays


def assert_same_numerics(before: tvm.IRModule, after: tvm.IRModule, rtol: float = 1e-5) -> None:
    arrays = inputs_for(before)
    ref, out = run_llvm(before, *arrays), run_llvm(after, *arrays)
    assert np.isfinite(ref).all()
    err = np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err <= rtol, f"relative error {err:.3e} > {rtol}"


# --- basic pattern: exporter layout ops, scale after QKᵀ ----------------------------------------


@I.ir_module
class Basic:
    @R.function
    def main(q: R.Tensor((2, 8, 64), "float32"), k: R.Tensor((2, 8, 64), "float32"),
             v: R.Tensor((2, 8, 64), "float32")) -> R.Tensor((2, 8, 64), "float32"):
        with R.dataflow():
            q4 = R.reshape(q, R.shape([2, 8, 4, 16]))
            k4 = R.reshape(k, R.shape([2, 8, 4, 16]))
            v4 = R.reshape(v, R.shape([2, 8, 4, 16]))
            qh = R.permute_dims(q4, axes=[0, 2, 1, 3])
            kt = R.permute_dims(k4, axes=[0, 2, 3, 1])
            vh = R.permute_dims(v4, axes=[0, 2, 1, 3])
            s = R.matmul(qh, kt)
            s2 = R.divide(s, R.const(4.0, "float32"))
            p = R.nn.softmax(s2, axis=-1)
            o = R.matmul(p, vh)
            o2 = R.permute_dims(o, axes=[0, 2, 1, 3])
            out = R.reshape(o2, R.shape([2, 8, 64]))
            R.output(out)
        return out


@I.ir_module
class BasicExpected:
    @R.function
    def main(q: R.Tensor((2, 8, 64), "float32"), k: R.Tensor((2, 8, 64), "float32"),
             v: R.Tensor((2, 8, 64), "float32")) -> R.Tensor((2, 8, 64), "float32"):
        with R.dataflow():
            q4 = R.reshape(q, R.shape([2, 8, 4, 16]))
            k4 = R.reshape(k, R.shape([2, 8, 4, 16]))
            v4 = R.reshape(v, R.shape([2, 8, 4, 16]))
            o = R.nn.attention(q4, k4, v4, scale=T.float32(0.25))
            out = R.reshape(o, R.shape([2, 8, 64]))
            R.output(out)
        return out


def test_basic():
    after = assert_fused(Basic, BasicExpected, causal="none", bias="no", group="1")
    assert_same_numerics(Basic, after)


# --- causal: triu of full(-inf), added (torch's eager mask) ---------------------------------------


@I.ir_module
class CausalTriu:
    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float32"), k: R.Tensor((2, 4, 8, 16), "float32"),
             v: R.Tensor((2, 4, 8, 16), "float32")) -> R.Tensor((2, 4, 8, 16), "float32"):
        with R.dataflow():
            kt = R.permute_dims(k, axes=[0, 1, 3, 2])
            s = R.matmul(q, kt)
            s2 = R.multiply(s, R.const(0.25, "float32"))
            full = R.full(R.shape([8, 8]), R.const(float("-inf"), "float32"), dtype="float32")
            mask = R.triu(full, 1)
            s3 = R.add(s2, mask)
            p = R.nn.softmax(s3, axis=-1)
            o = R.matmul(p, v)
            R.output(o)
        return o


@I.ir_module
class CausalTriuExpected:
    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float32"), k: R.Tensor((2, 4, 8, 16), "float32"),
             v: R.Tensor((2, 4, 8, 16), "float32")) -> R.Tensor((2, 4, 8, 16), "float32"):
        with R.dataflow():
            q1 = R.permute_dims(q, axes=[0, 2, 1, 3])
            k1 = R.permute_dims(k, axes=[0, 2, 1, 3])
            v1 = R.permute_dims(v, axes=[0, 2, 1, 3])
            a = R.nn.attention(q1, k1, v1, scale=T.float32(0.25), causal_mask="TopLeft")
            o = R.permute_dims(a, axes=[0, 2, 1, 3])
            R.output(o)
        return o


def test_causal_triu_additive():
    after = assert_fused(CausalTriu, CausalTriuExpected, causal="TopLeft")
    assert_same_numerics(CausalTriu, after)


# --- causal: masked_fill form where(j <= i, s, finfo.min) from arange, mask before the scale ------


@I.ir_module
class CausalWhere:
    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float32"), k: R.Tensor((2, 4, 8, 16), "float32"),
             v: R.Tensor((2, 4, 8, 16), "float32")) -> R.Tensor((2, 4, 8, 16), "float32"):
        with R.dataflow():
            kt = R.permute_dims(k, axes=[0, 1, 3, 2])
            s = R.matmul(q, kt)
            pos = R.arange(0, 8, 1, dtype="int64")
            row = R.expand_dims(pos, axis=[1])
            col = R.expand_dims(pos, axis=[0])
            keep = R.less_equal(col, row)
            s2 = R.where(keep, s, R.const(MIN, "float32"))
            s3 = R.multiply(s2, R.const(0.25, "float32"))
            p = R.nn.softmax(s3, axis=-1)
            o = R.matmul(p, v)
            R.output(o)
        return o


def test_causal_masked_fill_where():
    after = assert_fused(CausalWhere, CausalTriuExpected, causal="TopLeft")
    assert_same_numerics(CausalWhere, after)


# --- causal with a KV cache: Sq 4 < Skv 8, bottom-right aligned; HF SDPA IsNaN guard --------------


@I.ir_module
class BottomRightGuard:
    @R.function
    def main(q: R.Tensor((1, 4, 4, 16), "float32"), k: R.Tensor((1, 4, 8, 16), "float32"),
             v: R.Tensor((1, 4, 8, 16), "float32")) -> R.Tensor((1, 4, 4, 16), "float32"):
        with R.dataflow():
            kt = R.permute_dims(k, axes=[0, 1, 3, 2])
            s = R.matmul(q, kt)
            s2 = R.multiply(s, R.const(0.25, "float32"))
            full = R.full(R.shape([4, 8]), R.const(float("-inf"), "float32"), dtype="float32")
            mask = R.triu(full, 5)
            s3 = R.add(s2, mask)
            p = R.nn.softmax(s3, axis=-1)
            nan = R.isnan(p)
            p2 = R.where(nan, R.const(0.0, "float32"), p)
            o = R.matmul(p2, v)
            R.output(o)
        return o


@I.ir_module
class BottomRightGuardExpected:
    @R.function
    def main(q: R.Tensor((1, 4, 4, 16), "float32"), k: R.Tensor((1, 4, 8, 16), "float32"),
             v: R.Tensor((1, 4, 8, 16), "float32")) -> R.Tensor((1, 4, 4, 16), "float32"):
        with R.dataflow():
            q1 = R.permute_dims(q, axes=[0, 2, 1, 3])
            k1 = R.permute_dims(k, axes=[0, 2, 1, 3])
            v1 = R.permute_dims(v, axes=[0, 2, 1, 3])
            a = R.nn.attention(q1, k1, v1, scale=T.float32(0.25), causal_mask="BottomRight")
            o = R.permute_dims(a, axes=[0, 2, 1, 3])
            R.output(o)
        return o


def test_bottom_right_causal_with_isnan_guard():
    after = assert_fused(BottomRightGuard, BottomRightGuardExpected, causal="BottomRight",
                         isnan_guard="True")
    assert_same_numerics(BottomRightGuard, after)


# --- padding: attention_mask input → additive (B, 1, 1, Skv) bias ---------------------------------


@I.ir_module
class Padding:
    @R.function
    def main(q: R.Tensor((2, 8, 64), "float32"), k: R.Tensor((2, 8, 64), "float32"),
             v: R.Tensor((2, 8, 64), "float32"),
             attention_mask: R.Tensor((2, 8), "int64")) -> R.Tensor((2, 8, 64), "float32"):
        with R.dataflow():
            q4 = R.reshape(q, R.shape([2, 8, 4, 16]))
            k4 = R.reshape(k, R.shape([2, 8, 4, 16]))
            v4 = R.reshape(v, R.shape([2, 8, 4, 16]))
            qh = R.permute_dims(q4, axes=[0, 2, 1, 3])
            kt = R.permute_dims(k4, axes=[0, 2, 3, 1])
            vh = R.permute_dims(v4, axes=[0, 2, 1, 3])
            m = R.astype(attention_mask, "float32")
            inv = R.subtract(R.const(1.0, "float32"), m)
            neg = R.multiply(inv, R.const(MIN, "float32"))
            bias = R.reshape(neg, R.shape([2, 1, 1, 8]))
            s = R.matmul(qh, kt)
            s2 = R.multiply(s, R.const(0.25, "float32"))
            s3 = R.add(s2, bias)
            p = R.nn.softmax(s3, axis=-1)
            o = R.matmul(p, vh)
            o2 = R.permute_dims(o, axes=[0, 2, 1, 3])
            out = R.reshape(o2, R.shape([2, 8, 64]))
            R.output(out)
        return out


@I.ir_module
class PaddingExpected:
    @R.function
    def main(q: R.Tensor((2, 8, 64), "float32"), k: R.Tensor((2, 8, 64), "float32"),
             v: R.Tensor((2, 8, 64), "float32"),
             attention_mask: R.Tensor((2, 8), "int64")) -> R.Tensor((2, 8, 64), "float32"):
        with R.dataflow():
            q4 = R.reshape(q, R.shape([2, 8, 4, 16]))
            k4 = R.reshape(k, R.shape([2, 8, 4, 16]))
            v4 = R.reshape(v, R.shape([2, 8, 4, 16]))
            m = R.astype(attention_mask, "float32")
            inv = R.subtract(R.const(1.0, "float32"), m)
            neg = R.multiply(inv, R.const(MIN, "float32"))
            bias = R.reshape(neg, R.shape([2, 1, 1, 8]))
            a = R.nn.attention(q4, k4, v4, bias, scale=T.float32(0.25))
            out = R.reshape(a, R.shape([2, 8, 64]))
            R.output(out)
        return out


def test_padding_mask_becomes_bias():
    after = assert_fused(Padding, PaddingExpected, causal="none", bias="yes")
    assert_same_numerics(Padding, after)


# --- GQA: repeat_kv as expand_dims → broadcast_to → reshape; scale folded into Q and K -------------


@I.ir_module
class Gqa:
    @R.function
    def main(q: R.Tensor((1, 8, 64), "float32"), k: R.Tensor((1, 8, 32), "float32"),
             v: R.Tensor((1, 8, 32), "float32")) -> R.Tensor((1, 8, 64), "float32"):
        with R.dataflow():
            q4 = R.reshape(q, R.shape([1, 8, 4, 16]))
            k4 = R.reshape(k, R.shape([1, 8, 2, 16]))
            v4 = R.reshape(v, R.shape([1, 8, 2, 16]))
            qh = R.permute_dims(q4, axes=[0, 2, 1, 3])
            kh = R.permute_dims(k4, axes=[0, 2, 1, 3])
            vh = R.permute_dims(v4, axes=[0, 2, 1, 3])
            ke = R.expand_dims(kh, axis=[2])
            kb = R.broadcast_to(ke, R.shape([1, 2, 2, 8, 16]))
            kr = R.reshape(kb, R.shape([1, 4, 8, 16]))
            ve = R.expand_dims(vh, axis=[2])
            vb = R.broadcast_to(ve, R.shape([1, 2, 2, 8, 16]))
            vr = R.reshape(vb, R.shape([1, 4, 8, 16]))
            qs = R.multiply(qh, R.const(0.5, "float32"))
            kt = R.permute_dims(kr, axes=[0, 1, 3, 2])
            ks = R.multiply(kt, R.const(0.5, "float32"))
            s = R.matmul(qs, ks)
            p = R.nn.softmax(s, axis=-1)
            o = R.matmul(p, vr)
            o2 = R.permute_dims(o, axes=[0, 2, 1, 3])
            out = R.reshape(o2, R.shape([1, 8, 64]))
            R.output(out)
        return out


@I.ir_module
class GqaExpected:
    @R.function
    def main(q: R.Tensor((1, 8, 64), "float32"), k: R.Tensor((1, 8, 32), "float32"),
             v: R.Tensor((1, 8, 32), "float32")) -> R.Tensor((1, 8, 64), "float32"):
        with R.dataflow():
            q4 = R.reshape(q, R.shape([1, 8, 4, 16]))
            k4 = R.reshape(k, R.shape([1, 8, 2, 16]))
            v4 = R.reshape(v, R.shape([1, 8, 2, 16]))
            a = R.nn.attention(q4, k4, v4, scale=T.float32(0.25))
            out = R.reshape(a, R.shape([1, 8, 64]))
            R.output(out)
        return out


def test_gqa_repeat_kv_and_scale_folded_into_q_and_k():
    after = assert_fused(Gqa, GqaExpected, group="2", scale="0.25")
    assert_same_numerics(Gqa, after)


# --- GQA at one query (decode): Kᵀ's transpose next to the length-1 axis is part of the reshape ---


@I.ir_module
class GqaDecode:
    """(B, Hkv, 1, D) keys repeated and viewed as Kᵀ (B, H, D, 1) by one reshape: what
    CollapseViewChains leaves of repeat_kv → reshape → transpose when S = 1 (ONNX exports)."""

    @R.function
    def main(q: R.Tensor((2, 4, 1, 16), "float32"), k: R.Tensor((2, 2, 1, 16), "float32"),
             v: R.Tensor((2, 2, 1, 16), "float32")) -> R.Tensor((2, 4, 1, 16), "float32"):
        with R.dataflow():
            ke = R.expand_dims(k, axis=[2])
            kb = R.broadcast_to(ke, R.shape([2, 2, 2, 1, 16]))
            kt = R.reshape(kb, R.shape([2, 4, 16, 1]))
            ve = R.expand_dims(v, axis=[2])
            vb = R.broadcast_to(ve, R.shape([2, 2, 2, 1, 16]))
            vr = R.reshape(vb, R.shape([2, 4, 1, 16]))
            s = R.matmul(q, kt)
            s2 = R.multiply(s, R.const(0.25, "float32"))
            p = R.nn.softmax(s2, axis=-1)
            o = R.matmul(p, vr)
            R.output(o)
        return o


@I.ir_module
class GqaDecodeExpected:
    @R.function
    def main(q: R.Tensor((2, 4, 1, 16), "float32"), k: R.Tensor((2, 2, 1, 16), "float32"),
             v: R.Tensor((2, 2, 1, 16), "float32")) -> R.Tensor((2, 4, 1, 16), "float32"):
        with R.dataflow():
            q1 = R.permute_dims(q, axes=[0, 2, 1, 3])
            k1 = R.permute_dims(k, axes=[0, 2, 1, 3])
            v1 = R.permute_dims(v, axes=[0, 2, 1, 3])
            a = R.nn.attention(q1, k1, v1, scale=T.float32(0.25))
            o = R.permute_dims(a, axes=[0, 2, 1, 3])
            R.output(o)
        return o


def test_gqa_decode_repeat_with_unit_axis_moved():
    after = assert_fused(GqaDecode, GqaDecodeExpected, group="2")
    assert_same_numerics(GqaDecode, after)


# --- MQA through R.repeat -------------------------------------------------------------------------


@I.ir_module
class Mqa:
    @R.function
    def main(q: R.Tensor((1, 4, 8, 16), "float32"), k: R.Tensor((1, 1, 8, 16), "float32"),
             v: R.Tensor((1, 1, 8, 16), "float32")) -> R.Tensor((1, 4, 8, 16), "float32"):
        with R.dataflow():
            kr = R.repeat(k, 4, axis=1)
            vr = R.repeat(v, 4, axis=1)
            kt = R.permute_dims(kr, axes=[0, 1, 3, 2])
            s = R.matmul(q, kt)
            s2 = R.multiply(s, R.const(0.25, "float32"))
            p = R.nn.softmax(s2, axis=-1)
            o = R.matmul(p, vr)
            R.output(o)
        return o


@I.ir_module
class MqaExpected:
    @R.function
    def main(q: R.Tensor((1, 4, 8, 16), "float32"), k: R.Tensor((1, 1, 8, 16), "float32"),
             v: R.Tensor((1, 1, 8, 16), "float32")) -> R.Tensor((1, 4, 8, 16), "float32"):
        with R.dataflow():
            q1 = R.permute_dims(q, axes=[0, 2, 1, 3])
            k1 = R.permute_dims(k, axes=[0, 2, 1, 3])
            v1 = R.permute_dims(v, axes=[0, 2, 1, 3])
            a = R.nn.attention(q1, k1, v1, scale=T.float32(0.25))
            o = R.permute_dims(a, axes=[0, 2, 1, 3])
            R.output(o)
        return o


def test_mqa_repeat():
    after = assert_fused(Mqa, MqaExpected, group="4")
    assert_same_numerics(Mqa, after)


# --- an existing R.nn.attention is already one op -------------------------------------------------


@I.ir_module
class Existing:
    @R.function
    def main(q: R.Tensor((1, 8, 4, 16), "float32"), k: R.Tensor((1, 8, 2, 16), "float32"),
             v: R.Tensor((1, 8, 2, 16), "float32")) -> R.Tensor((1, 8, 4, 16), "float32"):
        with R.dataflow():
            o = R.nn.attention(q, k, v, scale=T.float32(0.25), causal_mask="TopLeft")
            R.output(o)
        return o


def test_existing_attention_is_kept_and_lowers_with_gqa():
    after = fuse(Existing)
    tvm.ir.assert_structural_equal(after.without_attr("tvmfuse.attention_decisions"), Existing)
    (d,) = decisions(after)
    assert d["status"] == "existing"
    q, k, v = inputs_for(Existing)
    out = run_llvm(Existing, q, k, v)
    kr, vr = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)  # GQA: query head h reads h // 2
    s = np.einsum("bihd,bjhd->bhij", q, kr) * 0.25
    s = np.where(np.tril(np.ones((8, 8), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), vr)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


# --- left alone: every "cannot prove" case records why --------------------------------------------


def _scores_module(mask_builder, axis: int = -1, extra_param: bool = False):
    """softmax(q·kᵀ/4 + mask) v with a mask from ``mask_builder(bb, s, mask_param)``."""
    bb = relax.BlockBuilder()
    t = relax.TensorType((2, 4, 8, 16), "float32")
    q, k, v = relax.Var("q", t), relax.Var("k", t), relax.Var("v", t)
    params = [q, k, v]
    m = None
    if extra_param:
        m = relax.Var("m", relax.TensorType((2, 1, 8, 8), "float32"))
        params.append(m)
    with bb.function("main", params):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            s = bb.emit(relax.op.matmul(q, kt))
            s = bb.emit(relax.op.multiply(s, relax.const(0.25, "float32")))
            s = mask_builder(bb, s, m)
            p = bb.emit(relax.op.nn.softmax(s, axis=axis))
            o = bb.emit_output(relax.op.matmul(p, v))
        bb.emit_func_output(o)
    return bb.get()


def _add_const(values: np.ndarray):
    def build(bb, s, _m):
        return bb.emit(relax.op.add(s, relax.const(values.astype("float32"))))

    return build


def _clamped(mask_builder, floor: float):
    """``max(mask(s), floor)``: XGLM's / the BART family's clamp after the mask."""

    def build(bb, s, m):
        s = mask_builder(bb, s, m)
        return bb.emit(relax.op.maximum(s, relax.const(floor, "float32")))

    return build


def _padding_bias(bb, s, m):
    row = bb.emit(relax.op.strided_slice(m, axes=[2], begin=[0], end=[1]))  # (B, 1, 1, S)
    return bb.emit(relax.op.add(s, row))


def test_clamp_after_a_causal_mask_is_dropped():
    """``max(s + causal, finfo.min)`` is s on the visible scores and keeps masked ones masked."""
    causal = np.triu(np.full((8, 8), np.finfo("float32").min, "float32"), 1)
    before = _scores_module(_clamped(_add_const(causal), float(np.finfo("float32").min)))
    after = fuse(before)
    (d,) = decisions(after)
    assert d["status"] == "fused" and d["causal"] == "TopLeft", d
    assert "maximum" not in after.script()
    assert_same_numerics(before, after)


def test_clamp_left_with_a_padding_mask():
    """A row the padding masks whole is uniform after the clamp, not what the kernel gives."""
    (unclamped,) = decisions(fuse(_scores_module(_padding_bias, extra_param=True)))
    assert unclamped["status"] == "fused", unclamped
    before = _scores_module(_clamped(_padding_bias, float(np.finfo("float32").min)), extra_param=True)
    assert_left(before, "maximum(scores, c) with a data-dependent mask")


def test_clamp_above_the_masking_floor_left():
    """``max(s, -10)`` changes visible scores below -10: no mask, a real op."""
    causal = np.triu(np.full((8, 8), -np.inf, "float32"), 1)
    assert_left(_scores_module(_clamped(_add_const(causal), -10.0)), "clamps more than masked scores")


def test_left_alone_non_causal_constant_mask():
    """A two-sided band |i - j| < 3 is neither causal nor a causal sliding window."""
    i = np.arange(8)
    band = np.where(np.abs(i[:, None] - i[None, :]) < 3, 0, -np.inf)
    assert_left(_scores_module(_add_const(band)), "constant mask is not causal")


@pytest.mark.parametrize("sq, skv, window, kind", [(8, 8, 3, "BottomRight"), (4, 8, 2, "BottomRight"),
                                                   (8, 5, 4, "TopLeft"), (8, 8, 1, "BottomRight")])
def test_sliding_window_band_constant(sq: int, skv: int, window: int, kind: str):
    """A constant causal band ``off - w < j - i <= off`` becomes ``window_size=w``."""
    off = skv - sq if kind == "BottomRight" else 0
    ones = np.ones((sq, skv), bool)
    band = np.where(np.tril(ones, off) & np.triu(ones, off - window + 1), 0, -np.inf)
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((2, 4, sq, 16), "float32"))
    k, v = (relax.Var(n, relax.TensorType((2, 4, skv, 16), "float32")) for n in "kv")
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            s = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
            s = bb.emit(relax.op.add(relax.op.multiply(s, relax.const(0.25, "float32")),
                                     relax.const(band.astype("float32"))))
            o = bb.emit_output(relax.op.matmul(relax.op.nn.softmax(s, axis=-1), v))
        bb.emit_func_output(o)
    before = bb.get()
    after = fuse(before)
    (d,) = decisions(after)
    assert d["status"] == "fused" and d["causal"] == kind and d["window"] == str(window), d
    (call,) = [b.value for b in after["main"].body.blocks[0].bindings
               if getattr(b.value, "op", None) == tvm.ir.Op.get("relax.nn.attention")]
    assert int(call.attrs.window_size) == window and call.attrs.causal_mask == kind
    assert_same_numerics(before, after)


# --- sliding window: Mistral's band, triu(-inf, 1) + tril(-inf, -w), added ------------------------


@I.ir_module
class WindowBand:
    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float32"), k: R.Tensor((2, 4, 8, 16), "float32"),
             v: R.Tensor((2, 4, 8, 16), "float32")) -> R.Tensor((2, 4, 8, 16), "float32"):
        with R.dataflow():
            kt = R.permute_dims(k, axes=[0, 1, 3, 2])
            s = R.matmul(q, kt)
            s2 = R.multiply(s, R.const(0.25, "float32"))
            full = R.full(R.shape([8, 8]), R.const(float("-inf"), "float32"), dtype="float32")
            mask = R.add(R.triu(full, 1), R.tril(full, -3))
            s3 = R.add(s2, mask)
            p = R.nn.softmax(s3, axis=-1)
            o = R.matmul(p, v)
            R.output(o)
        return o


@I.ir_module
class WindowBandExpected:
    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float32"), k: R.Tensor((2, 4, 8, 16), "float32"),
             v: R.Tensor((2, 4, 8, 16), "float32")) -> R.Tensor((2, 4, 8, 16), "float32"):
        with R.dataflow():
            q1 = R.permute_dims(q, axes=[0, 2, 1, 3])
            k1 = R.permute_dims(k, axes=[0, 2, 1, 3])
            v1 = R.permute_dims(v, axes=[0, 2, 1, 3])
            a = R.nn.attention(q1, k1, v1, scale=T.float32(0.25), causal_mask="BottomRight",
                               window_size=3)
            o = R.permute_dims(a, axes=[0, 2, 1, 3])
            R.output(o)
        return o


def test_sliding_window_band_additive():
    after = assert_fused(WindowBand, WindowBandExpected, causal="BottomRight", window="3")
    assert_same_numerics(WindowBand, after)


def test_constant_bias_varying_along_queries_is_the_kernels_bias():
    """A finite constant (Sq, Skv) bias with values other than 0 (T5's relative position bias,
    ALiBi as a full matrix) is no mask but an additive bias: the kernel adds it (left alone before
    session 24, the S×S scores in memory)."""
    alibi = -np.abs(np.arange(8)[None, :] - np.arange(8)[:, None]).astype(np.float32)
    before = _scores_module(_add_const(alibi))
    after = fuse(before)
    (d,) = decisions(after)
    assert (d["status"], d["causal"], d["bias"]) == ("fused", "none", "yes"), d
    assert_same_numerics(before, after)


def test_left_alone_constant_bias_with_masked_entries():
    """ALiBi and a causal -inf in one constant: neither a mask nor a finite bias, left alone."""
    i = np.arange(8)
    alibi = np.where(i[None, :] <= i[:, None], -np.abs(i[None, :] - i[:, None]), -np.inf)
    assert_left(_scores_module(_add_const(alibi)), "neither 0 nor a masking value")


def test_left_alone_softmax_over_wrong_axis():
    assert_left(_scores_module(lambda bb, s, m: s, axis=2), "softmax over axis 2")


def test_left_alone_data_mask_varying_along_queries():
    def build(bb, s, m):
        return bb.emit(relax.op.add(s, m))

    assert_left(_scores_module(build, extra_param=True), "varies along the query axis")


def test_left_alone_probabilities_used_elsewhere():
    bb = relax.BlockBuilder()
    t = relax.TensorType((2, 4, 8, 16), "float32")
    q, k, v = relax.Var("q", t), relax.Var("k", t), relax.Var("v", t)
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            s = bb.emit(relax.op.matmul(q, kt))
            p = bb.emit_output(relax.op.nn.softmax(s, axis=-1))
            o = bb.emit_output(relax.op.matmul(p, v))
        bb.emit_func_output(relax.Tuple([o, p]))
    assert_left(bb.get(), "probabilities have other users")


# --- one softmax, two P·V products (DiffLlama: the two value halves after CSE) -------------------


@I.ir_module
class SharedProbabilities:
    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float32"), k: R.Tensor((2, 2, 8, 16), "float32"),
             v: R.Tensor((2, 1, 8, 16), "float32"), w: R.Tensor((2, 2, 8, 16), "float32")
             ) -> R.Tensor((2, 4, 8, 16), "float32"):
        with R.dataflow():
            kr = R.repeat(k, 2, axis=1)
            kt = R.permute_dims(kr, axes=[0, 1, 3, 2])
            s = R.matmul(q, kt)
            s2 = R.multiply(s, R.const(0.25, "float32"))
            p = R.nn.softmax(s2, axis=-1)
            vt = R.tile(v, repeats=[1, 2, 1, 1])  # DiffLlama's v.repeat(1, 2, 1, 1): the operand
            vr = R.repeat(vt, 2, axis=1)
            o1 = R.matmul(p, vr)
            wr = R.repeat(w, 2, axis=1)
            o2 = R.matmul(p, wr)
            o = R.subtract(o1, o2)
            R.output(o)
        return o


@I.ir_module
class SharedProbabilitiesExpected:
    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float32"), k: R.Tensor((2, 2, 8, 16), "float32"),
             v: R.Tensor((2, 1, 8, 16), "float32"), w: R.Tensor((2, 2, 8, 16), "float32")
             ) -> R.Tensor((2, 4, 8, 16), "float32"):
        with R.dataflow():
            vt = R.tile(v, repeats=[1, 2, 1, 1])
            q1 = R.permute_dims(q, axes=[0, 2, 1, 3])
            k1 = R.permute_dims(k, axes=[0, 2, 1, 3])
            v1 = R.permute_dims(vt, axes=[0, 2, 1, 3])
            a1 = R.nn.attention(q1, k1, v1, scale=T.float32(0.25))
            o1 = R.permute_dims(a1, axes=[0, 2, 1, 3])
            w1 = R.permute_dims(w, axes=[0, 2, 1, 3])
            a2 = R.nn.attention(q1, k1, w1, scale=T.float32(0.25))
            o2 = R.permute_dims(a2, axes=[0, 2, 1, 3])
            o = R.subtract(o1, o2)
            R.output(o)
        return o


def test_shared_probabilities_become_one_attention_per_product():
    """Both readers of P are P·V products: each is its own attention (the scores are recomputed
    in the second kernel instead of stored), the tiled values materialised as they are."""
    after = fuse(SharedProbabilities)
    tvm.ir.assert_structural_equal(after.without_attr("tvmfuse.attention_decisions"),
                                   SharedProbabilitiesExpected)
    assert [(d["status"], d["group"]) for d in decisions(after)] == [("fused", "2")] * 2
    assert_same_numerics(SharedProbabilities, after)


# --- keys and values repeated by different factors (DiffLlama's ONNX export) -----------------------


@I.ir_module
class UnequalGroups:
    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float32"), k: R.Tensor((2, 2, 8, 16), "float32"),
             v: R.Tensor((2, 1, 8, 16), "float32")) -> R.Tensor((2, 4, 8, 16), "float32"):
        with R.dataflow():
            kr = R.repeat(k, 2, axis=1)  # keys 2x
            kt = R.permute_dims(kr, axes=[0, 1, 3, 2])
            s = R.matmul(q, kt)
            s2 = R.multiply(s, R.const(0.25, "float32"))
            p = R.nn.softmax(s2, axis=-1)
            vb = R.broadcast_to(v, R.shape([2, 4, 8, 16]))  # values 4x
            o = R.matmul(p, vb)
            R.output(o)
        return o


@I.ir_module
class UnequalGroupsExpected:
    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float32"), k: R.Tensor((2, 2, 8, 16), "float32"),
             v: R.Tensor((2, 1, 8, 16), "float32")) -> R.Tensor((2, 4, 8, 16), "float32"):
        with R.dataflow():
            q1 = R.permute_dims(q, axes=[0, 2, 1, 3])
            k1 = R.permute_dims(k, axes=[0, 2, 1, 3])
            vr = R.repeat(v, 2, axis=1)  # the extra 2x materialised: both grouped 2x
            v1 = R.permute_dims(vr, axes=[0, 2, 1, 3])
            a = R.nn.attention(q1, k1, v1, scale=T.float32(0.25))
            o = R.permute_dims(a, axes=[0, 2, 1, 3])
            R.output(o)
        return o


def test_unequal_kv_groups_share_the_smaller():
    after = assert_fused(UnequalGroups, UnequalGroupsExpected, group="2")
    assert_same_numerics(UnequalGroups, after)


def test_left_alone_attention_sinks():
    """GPT-OSS: a per-head sink logit joins each score row and is sliced off after the softmax."""
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(n, relax.TensorType((1, 4, 8, 16), "float32")) for n in "qkv")
    sink = relax.Var("sink", relax.TensorType((1, 4, 1, 1), "float32"))
    with bb.function("main", [q, k, v, sink]):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            s = bb.emit(relax.op.multiply(relax.op.matmul(q, kt), relax.const(0.25, "float32")))
            sinks = bb.emit(relax.op.broadcast_to(sink, relax.ShapeExpr([1, 4, 8, 1])))
            p = bb.emit(relax.op.nn.softmax(relax.op.concat([s, sinks], axis=-1), axis=-1))
            ps = bb.emit(relax.op.strided_slice(p, [3], [0], [8]))
            o = bb.emit_output(relax.op.matmul(ps, v))
        bb.emit_func_output(o)
    assert_left(bb.get(), "attention sinks")


def test_left_alone_tiled_kv_repetition():
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((1, 4, 8, 16), "float32"))
    k = relax.Var("k", relax.TensorType((1, 2, 8, 16), "float32"))
    v = relax.Var("v", relax.TensorType((1, 2, 8, 16), "float32"))
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            # tile: heads [k0, k1, k0, k1] — query head h reads KV head h % 2, not h // 2
            ke = bb.emit(relax.op.expand_dims(k, [1]))
            kb = bb.emit(relax.op.broadcast_to(ke, relax.ShapeExpr([1, 2, 2, 8, 16])))
            kr = bb.emit(relax.op.reshape(kb, relax.ShapeExpr([1, 4, 8, 16])))
            kt = bb.emit(relax.op.permute_dims(kr, [0, 1, 3, 2]))
            vr = bb.emit(relax.op.repeat(v, 2, axis=1))
            s = bb.emit(relax.op.matmul(q, kt))
            p = bb.emit(relax.op.nn.softmax(s, axis=-1))
            o = bb.emit_output(relax.op.matmul(p, vr))
        bb.emit_func_output(o)
    assert_left(bb.get(), "tiling")


def test_left_alone_causal_combined_with_padding():
    def build(bb, s, m):
        causal = np.where(np.tril(np.ones((8, 8), bool)), 0, -np.inf).astype("float32")
        s = bb.emit(relax.op.add(s, relax.const(causal)))
        pad = bb.emit(relax.op.strided_slice(m, [2], [0], [1]))  # (2, 1, 1, 8): a padding row
        return bb.emit(relax.op.add(s, pad))

    assert_left(_scores_module(build, extra_param=True), "combined with a data-dependent one")


def test_left_alone_isnan_guard_after_infinite_padding():
    bb = relax.BlockBuilder()
    t = relax.TensorType((2, 4, 8, 16), "float32")
    q, k, v = relax.Var("q", t), relax.Var("k", t), relax.Var("v", t)
    keep = relax.Var("keep", relax.TensorType((2, 1, 1, 8), "bool"))
    with bb.function("main", [q, k, v, keep]):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            s = bb.emit(relax.op.matmul(q, kt))
            s = bb.emit(relax.op.where(keep, s, relax.const(float("-inf"), "float32")))
            p = bb.emit(relax.op.nn.softmax(s, axis=-1))
            nan = bb.emit(relax.op.isnan(p))
            p2 = bb.emit(relax.op.where(nan, relax.const(0.0, "float32"), p))
            o = bb.emit_output(relax.op.matmul(p2, v))
        bb.emit_func_output(o)
    assert_left(bb.get(), "IsNaN guard")


def test_not_attention_is_not_recorded():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            p = bb.emit(relax.op.nn.softmax(x, axis=-1))
            o = bb.emit_output(relax.op.matmul(p, w))
        bb.emit_func_output(o)
    mod = bb.get()
    after = fuse(mod)
    tvm.ir.assert_structural_equal(after.without_attr("tvmfuse.attention_decisions"), mod)
    assert decisions(after) == []


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mixed_precision_keeps_scale_causal_and_bias(dtype):
    from tvmfuse.passes import MixedPrecision
    from tvmfuse.passes.legalize_fixes import legalize_overrides  # noqa: F401  (registers the fix)

    after = MixedPrecision(dtype)(fuse(Padding))
    calls = [b.value for b in after["main"].body.blocks[0].bindings
             if isinstance(b.value, relax.Call) and "attention" in str(b.value.op)]
    (call,) = calls
    assert call.op.name == "relax.nn.attention_bias"
    assert abs(float(call.attrs.scale.value) - 0.25) < 1e-7
    assert str(call.args[0].ty.dtype) == dtype and str(call.args[3].ty.dtype) == dtype


def test_no_kernel_for_spec_decomposes_with_gqa_and_causal(monkeypatch):
    """Where no kernel covers a spec (ValueError), the call lowers to plain ops, GQA kept."""
    import tvmfuse.rules.attention as attention_cpu  # the dispatcher's reference is the one called

    arrays = inputs_for(Existing)
    ref = run_llvm(Existing, *arrays)

    def refuse(spec):
        raise ValueError("no kernel")

    monkeypatch.setattr(attention_cpu, "attention_cpu_primfunc", refuse)
    from tvmfuse.passes.legalize_fixes import legalize_overrides

    lowered = relax.transform.LegalizeOps(legalize_overrides())(Existing)
    assert not any("attention" in gv.name_hint for gv in lowered.functions)
    np.testing.assert_allclose(run_llvm(Existing, *arrays), ref, rtol=1e-5, atol=1e-6)


# --- models: HF ONNX exports (both exporters), the torch decoder layer (torch.export and ONNX) -----
# Sequence 24 (head dim 16, hidden 64): an S×S tensor is the only one with two dims of 24.

SEQ = 24
def compile_and_check(imported, inputs: list[np.ndarray], layers: int) -> tvm.IRModule:
    """Lower for cpu; one attention op per layer, no S×S tensor, output matches the reference."""
    from tvmfuse.pipeline import build, lower
    from tvmfuse.targets import get_target

    stages: dict[str, tvm.IRModule] = {}
    spec = get_target("cpu")
    lowered = lower(imported.mod, spec, on_stage=lambda n, m: stages.__setitem__(n, m))
    fused = stages["fuse_attention"]
    text = fused.script(show_meta=False)
    assert text.count("R.nn.attention") == layers, [d for d in attention_decisions(fused)]
    assert "R.nn.softmax" not in text
    assert all(d["status"] == "fused" for d in attention_decisions(fused))
    assert sxs_tensors(stages["finalize"], SEQ) == []
    vm = relax.VirtualMachine(build(lowered, spec), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
    out = out[0] if not hasattr(out, "numpy") else out
    (ref,) = imported.reference(*inputs)[:1]
    err = np.linalg.norm(out.numpy().astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err <= 1e-4, err
    return stages["finalize"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_attention")


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "llama_sdpa"])
def test_hf_export_one_attention_per_layer(name, exporter, hf_dir, monkeypatch):
    from models import hf_models
    from tvmfuse.frontend import import_model

    monkeypatch.setattr(hf_models, "SEQ", SEQ)
    path = hf_models.MODELS[name](hf_dir, exporter)
    imported = import_model(str(path))
    compile_and_check(imported, hf_models.sample_inputs(name, 1), hf_models.LAYERS)


def test_sxs_check_sees_the_unfused_scores():
    """The S×S check is not vacuous: without FuseAttention the scores are in the memory plan."""
    from models import decoder_layer
    from tvmfuse.frontend import import_model
    from tvmfuse.pipeline import lower
    from tvmfuse.targets import get_target

    module, example = decoder_layer.build(seq=SEQ)
    imported = import_model(module, example)
    stages: dict[str, tvm.IRModule] = {}
    import tvmfuse.pipeline as pipeline

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "FuseAttention", lambda: tvm.transform.Sequential([]))
        lower(imported.mod, get_target("cpu"), on_stage=lambda n, m: stages.__setitem__(n, m))
    assert sxs_tensors(stages["finalize"], SEQ)


@pytest.mark.parametrize("frontend", ["torch", "onnx"])
def test_decoder_layer_one_attention(frontend, tmp_path):
    from models import decoder_layer
    from models.export_onnx import export_onnx
    from tvmfuse.frontend import import_model

    module, example = decoder_layer.build(seq=SEQ)
    if frontend == "torch":
        imported = import_model(module, example)
    else:
        imported = import_model(str(export_onnx(module, example, tmp_path / "decoder.onnx")))
    compile_and_check(imported, [example[0].numpy()], 1)

