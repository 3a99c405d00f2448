"""FuseAttention on torch.export's decomposition of ``F.scaled_dot_product_attention`` (half inputs).

torch decomposes SDPA on half inputs into: an fp32 upcast of Q, K and V, ``sqrt(scale)`` on Q and
on Kᵀ, 3-D batched matmuls (``broadcast_to`` + ``reshape``, ``expand_dims`` for ``enable_gqa``), a
causal mask from ``arange``/``full``/``logical_and``/``where``, torch's ``_safe_softmax`` guard
(0 for a row of all -inf scores), the cast back to half and a chain of output permutes. Model
level: the benchmark module of ``tools/bench/bench_attention.py`` lowers to exactly one attention
kernel on sm90 (the wgmma prefill or the split-KV decode kernel), sm80 and cpu, and the cpu build
matches torch. Unit level: the guard's Before/Expected, the guard after a data-dependent -inf mask
(dropped by the kernel contract: fully masked rows give 0, checked with such a row), and what is
left alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from torch import nn
from tvm import relax
from tvm.script import ir as I  # noqa: E741
from tvm.script import relax as R
from tvm.script import tirx as T

from tests.relax_util import apply_pass, run_llvm
from tvmfuse.passes.attention import FuseAttention, attention_decisions


class SDPA(nn.Module):
    """``F.scaled_dot_product_attention`` on BSNH tensors, as in tools/bench/bench_attention.py."""

    def __init__(self, causal: bool, gqa: bool) -> None:
        super().__init__()
        self.causal, self.gqa = causal, gqa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=self.causal, enable_gqa=self.gqa)
        return o.transpose(1, 2)


# name → (causal, gqa, B, Sq, Skv, Hq, Hkv, D); Skv 40 is no multiple of any kernel tile
CASES = {
    "causal": (True, False, 2, 40, 40, 4, 4, 64),
    "noncausal": (False, False, 2, 40, 40, 4, 4, 64),
    "gqa_causal": (True, True, 2, 40, 40, 8, 2, 64),
    "gqa_d128": (False, True, 1, 40, 40, 8, 2, 128),
    "decode_gqa": (False, True, 2, 1, 40, 8, 2, 64),
    "decode_causal": (True, False, 2, 1, 40, 4, 4, 64),  # torch's is_causal is TopLeft: key 0 only
}
TOL = {"float16": 1e-3, "bfloat16": 8e-3}  # measured ≈ 2e-4 / 1.7e-3, torch's own half SDPA 2.6e-4 / 2.1e-3


def _inputs(case: str, dtype: str) -> tuple[torch.Tensor, ...]:
    _, _, b, sq, skv, hq, hkv, d = CASES[case]
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    return (torch.randn(b, sq, hq, d, generator=g).to(dt), torch.randn(b, skv, hkv, d, generator=g).to(dt),
            torch.randn(b, skv, hkv, d, generator=g).to(dt))


def _lower(case: str, dtype: str, target: str):
    from tvmfuse.frontend import import_model
    from tvmfuse.pipeline import lower
    from tvmfuse.targets import get_target

    causal, gqa = CASES[case][:2]
    imported = import_model(SDPA(causal, gqa), _inputs(case, dtype))
    stages: dict[str, tvm.IRModule] = {}
    lowered = lower(imported.mod, get_target(target), on_stage=lambda n, m: stages.__setitem__(n, m))
    return lowered, stages


def _check_one_attention(case: str, stages: dict[str, tvm.IRModule], lowered: tvm.IRModule) -> None:
    causal, _, _, sq, skv, hq, hkv, d = CASES[case]
    fused = stages["fuse_attention"]
    text = fused.script(show_meta=False)
    assert text.count("R.nn.attention") == 1, attention_decisions(fused)
    assert "R.nn.softmax" not in text and "R.matmul" not in text and "R.astype" not in text
    (dec,) = attention_decisions(fused)
    assert dec["status"] == "fused", dec
    assert dec["causal"] == ("TopLeft" if causal else "none") and dec["group"] == str(hq // hkv)
    assert dec["safe_softmax_guard"] == "dropped: no row can be fully masked"
    assert abs(float(dec["scale"]) - d ** -0.5) < 1e-6 * d ** -0.5  # sqrt(scale) on q and on k
    kernels = [gv.name_hint for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert kernels == ["attention"], kernels


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_one_kernel_sm90(case, dtype):
    lowered, stages = _lower(case, dtype, "sm90")
    _check_one_attention(case, stages, lowered)
    (func,) = [f for f in stages["legalize"].functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    if CASES[case][3] == 1:
        assert str(func.attrs["global_symbol"]) == "flash_decode"
    else:
        assert str(func.attrs["tvmfuse.rule"]) == "flash_attention_sm90", func.attrs
    assert func.attrs["tirx.is_scheduled"]  # dlight leaves the kernel alone


@pytest.mark.parametrize("case", ["causal", "decode_gqa"])
def test_sdpa_one_kernel_sm80(case):
    """The sm80 flash and decode kernels pass the pipeline's dlight stage (tirx.is_scheduled)."""
    lowered, stages = _lower(case, "float16", "sm80")
    _check_one_attention(case, stages, lowered)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_cpu_matches_torch(case, dtype):
    from tvmfuse.pipeline import build
    from tvmfuse.targets import get_target

    lowered, stages = _lower(case, dtype, "cpu")
    _check_one_attention(case, stages, lowered)
    vm = relax.VirtualMachine(build(lowered, get_target("cpu")), tvm.cpu())
    q, k, v = _inputs(case, dtype)
    out = vm["main"](*[tvm.runtime.from_dlpack(x.contiguous()) for x in (q, k, v)])
    out = out[0] if not hasattr(out, "numpy") else out
    got = torch.from_dlpack(out).double()
    assert str(got.dtype) == "torch.float64" and tuple(got.shape) == tuple(q.shape)
    ref = SDPA(*CASES[case][:2])(q.double(), k.double(), v.double())
    err = float((got - ref).norm() / ref.norm())
    torch_err = float((SDPA(*CASES[case][:2])(q, k, v).double() - ref).norm() / ref.norm())
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]} (torch's own: {torch_err:.2e})"


# --- unit level -------------------------------------------------------------------------------


@I.ir_module
class SafeSoftmax:
    """What torch.export + the importer make of SDPA(is_causal=True) on fp16 (B2 S8 H4 D16)."""

    @R.function
    def main(q: R.Tensor((2, 8, 4, 16), "float16"), k: R.Tensor((2, 8, 4, 16), "float16"),
             v: R.Tensor((2, 8, 4, 16), "float16")) -> R.Tensor((2, 8, 4, 16), "float16"):
        with R.dataflow():
            qh = R.permute_dims(q, axes=[0, 2, 1, 3])
            kh = R.permute_dims(k, axes=[0, 2, 1, 3])
            vh = R.permute_dims(v, axes=[0, 2, 1, 3])
            q32 = R.astype(qh, dtype="float32")
            k32 = R.astype(kh, dtype="float32")
            v32 = R.astype(vh, dtype="float32")
            qs = R.multiply(q32, R.const(0.5, "float32"))
            ones = R.full(R.shape([8, 8]), R.const(True, "bool"), dtype="bool")
            cols = R.expand_dims(R.arange(0, 8, 1, dtype="int64"), axis=[-2])
            rows = R.expand_dims(R.arange(0, 8, 1, dtype="int64"), axis=[-1])
            tril = R.less_equal(R.subtract(cols, rows), R.const(0, "int64"))
            keep = R.logical_and(tril, ones)
            mask = R.where(keep, R.const(0.0, "float32"), R.const(float("-inf"), "float32"))
            kt = R.permute_dims(k32, axes=[0, 1, 3, 2])
            ks = R.multiply(kt, R.const(0.5, "float32"))
            q3 = R.reshape(R.broadcast_to(qs, R.shape([2, 4, 8, 16])), R.shape([8, 8, 16]))
            k3 = R.reshape(R.broadcast_to(ks, R.shape([2, 4, 16, 8])), R.shape([8, 16, 8]))
            s3 = R.matmul(q3, k3, out_dtype="float32")
            s = R.reshape(s3, R.shape([2, 4, 8, 8]))
            sm = R.add(s, mask)
            p = R.nn.softmax(sm, axis=-1)
            masked = R.equal(sm, R.const(float("-inf"), "float32"))
            seen = R.astype(R.logical_not(masked), dtype="int8")
            any_seen = R.astype(R.max(seen, axis=[-1], keepdims=True), dtype="bool")
            dead = R.logical_not(any_seen)
            zeros = R.full_like(p, R.const(0.0, "float32"))
            ps = R.where(dead, zeros, p)
            p3 = R.reshape(R.broadcast_to(ps, R.shape([2, 4, 8, 8])), R.shape([8, 8, 8]))
            v3 = R.reshape(R.broadcast_to(v32, R.shape([2, 4, 8, 16])), R.shape([8, 8, 16]))
            o3 = R.matmul(p3, v3, out_dtype="float32")
            o = R.astype(R.reshape(o3, R.shape([2, 4, 8, 16])), dtype="float16")
            o1 = R.permute_dims(o, axes=[2, 0, 1, 3])
            o2 = R.permute_dims(o1, axes=[1, 2, 0, 3])
            out = R.permute_dims(o2, axes=[0, 2, 1, 3])
            R.output(out)
        return out


@I.ir_module
class SafeSoftmaxExpected:
    @R.function
    def main(q: R.Tensor((2, 8, 4, 16), "float16"), k: R.Tensor((2, 8, 4, 16), "float16"),
             v: R.Tensor((2, 8, 4, 16), "float16")) -> R.Tensor((2, 8, 4, 16), "float16"):
        with R.dataflow():
            out = R.nn.attention(q, k, v, scale=T.float32(0.25), causal_mask="TopLeft")
            R.output(out)
        return out


def _normalized(mod: tvm.IRModule) -> tvm.IRModule:
    return relax.transform.Normalize()(mod)


def test_safe_softmax_upcast_causal_before_expected():
    after = apply_pass(FuseAttention(), _normalized(SafeSoftmax))
    tvm.ir.assert_structural_equal(after.without_attr("tvmfuse.attention_decisions"),
                                   SafeSoftmaxExpected)
    (d,) = attention_decisions(after)
    assert d["status"] == "fused" and d["causal"] == "TopLeft" and d["upcast"] == "float16->float32"
    assert d["safe_softmax_guard"] == "dropped: no row can be fully masked"
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((2, 8, 4, 16)).astype("float16") for _ in range(3)]
    ref = run_llvm(_normalized(SafeSoftmax), *arrays).astype(np.float64)
    out = run_llvm(after, *arrays).astype(np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-3


def _guarded_padding(guard: str = "safe", all_axis: int = -1) -> tvm.IRModule:
    """fp32 attention with a bool key mask (-inf where masked) and a _safe_softmax guard."""
    bb = relax.BlockBuilder()
    t = relax.TensorType((2, 4, 8, 16), "float32")
    q, k, v = relax.Var("q", t), relax.Var("k", t), relax.Var("v", t)
    keep = relax.Var("keep", relax.TensorType((2, 1, 1, 8), "bool"))
    with bb.function("main", [q, k, v, keep]):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            s = bb.emit(relax.op.multiply(relax.op.matmul(q, kt), relax.const(0.25, "float32")))
            s = bb.emit(relax.op.where(keep, s, relax.const(float("-inf"), "float32")))
            p = bb.emit(relax.op.nn.softmax(s, axis=-1))
            masked = bb.emit(relax.op.equal(s, relax.const(float("-inf"), "float32")))
            if guard == "safe":  # all(masked) as not(any(not masked)), as torch.export writes it
                seen = bb.emit(relax.op.astype(relax.op.logical_not(masked), "int8"))
                anyseen = bb.emit(relax.op.max(seen, axis=[all_axis], keepdims=True))
                dead = bb.emit(relax.op.logical_not(relax.op.astype(anyseen, "bool")))
            else:  # a where that zeroes rows by some other condition: not the guard
                dead = bb.emit(relax.op.logical_not(keep))
            zeros = bb.emit(relax.op.full_like(p, relax.const(0.0, "float32")))
            p2 = bb.emit(relax.op.where(dead, zeros, p))
            o = bb.emit_output(relax.op.matmul(p2, v))
        bb.emit_func_output(o)
    return bb.get()


def test_safe_softmax_after_infinite_padding_relies_on_kernel_contract(monkeypatch):
    """A batch whose keys are all masked: the guard gives 0 rows; so do the kernel and the decomposition."""
    before = _guarded_padding()
    after = apply_pass(FuseAttention(), before)
    (d,) = attention_decisions(after)
    assert d["status"] == "fused" and d["bias"] == "yes", d
    assert d["safe_softmax_guard"] == "dropped: a fully masked row gives 0 (kernel contract)"
    text = after.script(show_meta=False)
    assert "R.nn.softmax" not in text and "R.max" not in text and "R.nn.attention" in text
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((2, 4, 8, 16)).astype("float32") for _ in range(3)]
    keep = np.ones((2, 1, 1, 8), bool)
    keep[0, ..., 5:] = False  # batch 0 keeps 5 keys
    keep[1] = False  # batch 1 sees nothing: every row of its scores is -inf
    arrays.append(keep)
    ref = run_llvm(before, *arrays)
    assert np.isfinite(ref).all() and not ref[1].any() and ref[0].any()
    np.testing.assert_allclose(run_llvm(after, *arrays), ref, rtol=1e-5, atol=1e-6)

    import tvmfuse.rules.attention as attention_cpu  # the dispatcher's reference is the one called

    def refuse(spec):
        raise ValueError("no kernel")

    monkeypatch.setattr(attention_cpu, "attention_cpu_primfunc", refuse)
    from tvmfuse.passes.legalize_fixes import legalize_overrides

    lowered = relax.transform.LegalizeOps(legalize_overrides())(after)
    assert not any("attention" in gv.name_hint for gv in lowered.functions)
    np.testing.assert_allclose(run_llvm(after, *arrays), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["other_condition", "all_over_queries"])
def test_left_alone_where_that_is_no_guard(variant):
    before = (_guarded_padding(guard="other") if variant == "other_condition"
              else _guarded_padding(all_axis=2))
    after = apply_pass(FuseAttention(), before)
    tvm.ir.assert_structural_equal(after.without_attr("tvmfuse.attention_decisions"), before)
    (d,) = attention_decisions(after)
    assert d["status"] == "left" and "_safe_softmax guard" in d["reason"], d


def test_inexact_cast_chain_on_attention_is_kept():
    """f32 attention → f16 → f32 rounds: the casts stay (only half → f32 → half is collapsed)."""
    bb = relax.BlockBuilder()
    t = relax.TensorType((2, 8, 4, 16), "float32")
    q, k, v = relax.Var("q", t), relax.Var("k", t), relax.Var("v", t)
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            o = bb.emit(relax.op.nn.attention(q, k, v, scale=0.25))
            o = bb.emit(relax.op.permute_dims(o, [0, 2, 1, 3]))
            o = bb.emit(relax.op.astype(o, "float16"))
            o = bb.emit(relax.op.astype(o, "float32"))
            o = bb.emit_output(relax.op.permute_dims(o, [0, 2, 1, 3]))
        bb.emit_func_output(o)
    before = bb.get()
    after = apply_pass(FuseAttention(), before)
    tvm.ir.assert_structural_equal(after.without_attr("tvmfuse.attention_decisions"), before)


class _BertOut(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, attention_mask=attention_mask).last_hidden_state


def test_transformers_bert_padding_mask_is_fused():
    """transformers 5 builds BERT's bidirectional padding mask as ``full(True) & (q_idx >= 0) &
    mask[b, kv_idx]`` with ``bitwise_and`` on bools, which FuseAttention did not split (the
    attention stayed 5 kernels, "data-dependent mask ... varies along the query axis"). Now one
    attention per layer, and the cpu build matches torch with padded keys — and with a sequence
    whose keys are all masked (torch's safe softmax: a zero row)."""
    transformers = pytest.importorskip("transformers")
    import tvmfuse
    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=256)
    model = _BertOut(transformers.BertModel(cfg).eval()).eval()
    ids = torch.randint(0, 128, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.int64)
    mask[0, 28:] = 0
    report = analyze(import_model(model, (ids, mask)).mod, get_target("cpu"), stock=False)
    assert sum(k["name"] == "attention" for k in report["kernels"]) == 2, report["kernels"]
    lib = tvmfuse.compile(model, (ids, mask), target="cpu").load()
    for m in (mask, torch.cat([mask[:1], torch.zeros_like(mask[:1])])):
        with torch.no_grad():
            want = model(ids, m).numpy()
        got = np.asarray(lib(ids, m))
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), m
