"""FoldDecodeAppend (rules/fold_decode_append.py): compile_lm's decode append folded into the
split-KV attention kernel, one launch a layer fewer. GPU numerics: test_llm_compile_lm's
``test_sm90_generate_on_the_gpu`` (greedy tokens against torch, the fold on by default)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import tvm
from tvm import tirx

from tests.cuda_tools import kernel_sass, needs_nvcc
from tests.lm_reference import tiny_llama
from tests.test_llm_kv_cache import DECODE, DECODE_ROWS, _cache_attention_ref, _caches, _state
from tvmfuse.build.inspect import fatbin_sass
from tvmfuse.build.nvcc import compile_fatbin
from tvmfuse.kernels.attention.flash_decode import DecodeConfig, NewToken, flash_decode_cache_primfunc
from tvmfuse.kernels.tir_util import UnknownExpr, substitute
from tvmfuse.llm.kernels import CacheSpec
from tvmfuse.options import current_options, use_options
from tvmfuse.targets import get_target
from tvmfuse.tvm_setup import codegen_scope

pytest.importorskip("transformers")

import tvmfuse  # noqa: E402
from tvmfuse.build.inspect import cuda_source  # noqa: E402


def _kernels(lib) -> list[str]:
    return re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(",
                      cuda_source(lib.executable))


def _compile(fold: bool, cluster: str = "pdl"):
    # the append kernel as it is without the QKV GEMV making its stores (rules/gemv_append.py)
    opts = dataclasses.replace(current_options(), decode_fold_append=fold,
                               decode_cluster_combine=cluster, decode_gemv_append=False)
    with use_options(opts):
        return tvmfuse.compile_lm(tiny_llama().half(), target="sm90", max_seq_len=64, max_batch=2,
                                  prefill_lengths=[16])


@needs_nvcc
@pytest.mark.slow
def test_sm90_decode_loses_the_append_kernel(tmp_path):
    """With the fold the decode step has no append kernel: the layers' shared attention PrimFunc
    is rebuilt once with the append inside (its partial and combine kernels), the rest of the
    kernels are the same; nvcc builds it (sm_90a SASS without local-memory spills)."""
    plain, folded = _compile(False), _compile(True)
    before, after = set(_kernels(plain)), set(_kernels(folded))
    appends = {n for n in before if "decode_append" in n}
    assert len(appends) == 1 and not any("decode_append" in n for n in after), (before, after)
    attention = {n for n in before if re.fullmatch(r"decode_cache_attention\d+_kernel(_1)?", n)}
    assert len(attention) == 2, before  # the partial and the combine
    new = after - before
    assert new == {n.replace("_kernel", "_append_kernel") for n in attention}, new
    assert before - after == appends | attention
    sass = next(iter(kernel_sass(folded.export(tmp_path / "lm.so")).values()))
    partial = next(text for name, text in sass.items() if name.endswith("attention0_append_kernel"))
    assert "LDG" in partial and "STL" not in partial


@needs_nvcc
@pytest.mark.slow
def test_the_cluster_combine_kernel_keeps_its_append():
    """The cluster-combine attention has no form with the append inside: with both options the
    fold leaves the decode step's append and its one attention kernel as they are."""
    names = set(_kernels(_compile(True, cluster="on")))
    assert any("decode_append" in n for n in names), names
    assert {n for n in names if "cache_attention" in n} == {"decode_cache_attention0_kernel"}, names


def test_substitute_replaces_the_block_vars():
    """The value expression of the append's store, rebuilt with (b, h, d) for its block vars."""
    vh, vd = tirx.Var("vh", "int64"), tirx.Var("vd", "int64")
    buf = tirx.decl_buffer((4, 8), "float16", name="x")
    expr = tirx.if_then_else(vh < 2, tirx.BufferLoad(buf, [vh, vd]) * tirx.const(2, "float16"),
                             tirx.BufferLoad(buf, [vh, tirx.floormod(vd + 4, 8)]))
    h = tirx.Var("h", "int32")
    got = substitute(expr, [(vh, tirx.Cast("int64", h)), (vd, tirx.IntImm("int64", 3))])
    def i64(n):
        return tirx.IntImm("int64", n)

    h64, three = tirx.Cast("int64", h), i64(3)
    expected = tirx.if_then_else(h64 < 2, tirx.BufferLoad(buf, [h64, three]) * tirx.const(2, "float16"),
                                 tirx.BufferLoad(buf, [h64, tirx.FloorMod(tirx.Add(three, i64(4)), i64(8))]))
    tvm.ir.assert_structural_equal(got, expected)  # rebuilt node for node (no constant folding)
    tvm.ir.assert_structural_equal(substitute(expr, []), expr)  # nothing to replace


def test_substitute_declines_unknown_kinds():
    """An expression kind it does not rebuild makes the fold decline (both kernels stay)."""
    v = tirx.Var("v", "int32")
    with pytest.raises(UnknownExpr):
        substitute(tvm.tirx.Let(v, 1, v + 1), [])


# the kernel alone: this step's q, k, v = 2·x (an elementwise expression standing in for RoPE)
CONFIGS = {"plain": DecodeConfig(), "fused_combine": DecodeConfig(fused_combine=True),
           "prefetch": DecodeConfig(l2_prefetch=True), "pipeline": DecodeConfig(unroll=4, pipeline=True)}


def _folded(spec: CacheSpec, config: DecodeConfig) -> tvm.tirx.PrimFunc:
    """``(state, offsets, starts, sync, x, out)``: the attention doing the append of 2·x."""
    x = tirx.decl_buffer((spec.batch, spec.q_heads + 2 * spec.kv_heads, spec.head_dim), spec.dtype,
                         name="x")
    kernel = flash_decode_cache_primfunc(spec.attention_spec(), config=config, new_token=NewToken(
        lambda b, h, d: x[b, h, d] * tirx.const(2, spec.dtype)))
    return tirx.PrimFunc([*kernel.params[:4], x, kernel.params[4]], kernel.body,
                         attrs=kernel.attrs).with_attr("global_symbol", "main")


@needs_nvcc
@pytest.mark.parametrize("name", list(CONFIGS))
def test_folded_kernel_builds_without_spills(name, tmp_path):
    """nvcc builds every variant for sm_90a with 16-byte cache loads and no spills."""
    target = get_target("sm90")
    with codegen_scope():
        source = cuda_source(tvm.compile(tvm.IRModule({"main": _folded(DECODE, CONFIGS[name])}),
                                         target=target.tvm_target()))
    text = next(t for arch, t in fatbin_sass(compile_fatbin(source, target, tmp_path)).items()
                if arch.startswith("sm_"))
    assert "LDG.E.128" in text and "BAR.SYNC" in text
    log = (tmp_path / "kernels.ptxas.log").read_text()
    assert all(n == "0" for n in re.findall(r"(\d+) bytes spill stores", log)), log


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_folded_kernel_numerics_on_the_gpu(name):
    """H200: the folded kernel against float64 numpy: the new key and value land in slot
    offsets[b] (not past the cache: offset 1500 writes nothing), nothing else of the state
    changes, and the output attends over the cache with that slot and q = 2·x; three calls on
    the same counters."""
    spec, dev = DECODE, tvm.cuda()
    lib = tvm.compile(tvm.IRModule({"main": _folded(spec, CONFIGS[name])}),
                      target=get_target("sm90").tvm_target())
    sync = tvm.runtime.tensor(np.zeros(spec.sync_shape, "int32"), dev)
    offsets, starts = (np.array(a, "int32") for a in DECODE_ROWS)
    hq, hkv = spec.q_heads, spec.kv_heads
    for seed in (3, 4, 5):
        rng = np.random.default_rng(seed)
        kc, vc = (rng.standard_normal(spec.cache_shape).astype(spec.dtype) for _ in range(2))
        x = rng.standard_normal((spec.batch, hq + 2 * hkv, spec.head_dim)).astype(spec.dtype)
        new = (2 * x.astype("float32")).astype(spec.dtype)
        ref_k, ref_v = kc.copy(), vc.copy()
        for b, off in enumerate(offsets):
            if off < spec.max_seq:
                ref_k[b, :, off], ref_v[b, :, off] = new[b, hq:hq + hkv], new[b, hq + hkv:]
        ref = _cache_attention_ref(spec, new[:, None, :hq], ref_k, ref_v, offsets, starts)
        state = tvm.runtime.tensor(_state(spec, kc, vc), dev)
        out = tvm.runtime.empty(spec.q_shape, spec.dtype, dev)
        lib(state, *[tvm.runtime.tensor(a, dev) for a in (offsets, starts)], sync,
            tvm.runtime.tensor(x, dev), out)
        got_k, got_v, _ = _caches(spec, state.numpy())
        np.testing.assert_array_equal(got_k, ref_k)
        np.testing.assert_array_equal(got_v, ref_v)
        got = out.numpy().astype("float64")
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < 2e-3, (seed, err)
        assert not sync.numpy().any(), sync.numpy()


class _Captured(Exception):
    """Stops compile_lm's lowering once the module FoldDecodeAppend receives is captured."""


def _pass_input(monkeypatch) -> tvm.IRModule:
    """compile_lm's sm90 module as the fold_decode_append stage receives it (no tuning database:
    the module after ``reshape_to_view``)."""
    import importlib

    compile_lm = importlib.import_module("tvmfuse.llm.compile_lm")
    real, seen = compile_lm.lower, {}

    def lower(*args, **kwargs):
        def on_stage(name, mod):
            if name == "reshape_to_view":
                seen["mod"] = mod
                raise _Captured

        return real(*args, on_stage=on_stage, **kwargs)

    monkeypatch.setattr(compile_lm, "lower", lower)
    with pytest.raises(_Captured):
        tvmfuse.compile_lm(tiny_llama().half(), target="sm90", max_seq_len=64, max_batch=2,
                           prefill_lengths=[16])
    return seen["mod"]


def _calls(func) -> list:
    """(op name, callee name, call) of every call_tir / call_tir_inplace in ``func``'s bindings."""
    out = []
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, tvm.relax.Call) and getattr(v.op, "name", "") in (
                    "relax.call_tir", "relax.call_tir_inplace"):
                out.append((v.op.name, v.args[0].name_hint, v))
    return out


def test_pass_folds_each_layers_append_and_leaves_its_input(monkeypatch):
    """On the decode step: each layer's append call and attention call become one
    ``call_tir_inplace`` (the cache in place, the output new) of one shared rebuilt kernel, whose
    arguments are the cache, offsets, starts, counters, then the append's other inputs; the two
    PrimFuncs it replaces leave the module; the caller's module is not modified; with the option
    off nothing changes."""
    from tvmfuse.attrs import CACHE_ATTENTION_ATTR
    from tvmfuse.rules.fold_decode_append import FoldDecodeAppend

    mod = _pass_input(monkeypatch)
    before = _calls(mod["decode"])
    appends = [c for c in before if "decode_append" in c[1]]
    attentions = [c for c in before if c[1] == "decode_cache_attention0"]
    assert len(appends) == 2 and len(attentions) == 2 and all(
        c[0] == "relax.call_tir_inplace" for c in appends), before
    text = mod.script()
    with get_target("sm90").tvm_target():
        with use_options(dataclasses.replace(current_options(), decode_fold_append=False)):
            assert FoldDecodeAppend()(mod).same_as(mod)
        with use_options(dataclasses.replace(current_options(), decode_fold_append=True)):
            after = FoldDecodeAppend()(mod)
    assert mod.script() == text  # the input module is left as it was
    calls = _calls(after["decode"])
    assert not [c for c in calls if "decode_append" in c[1] or c[1] == "decode_cache_attention0"]
    folded = [c for c in calls if c[1].startswith("decode_cache_attention0_append")]
    assert len(folded) == 2 and len({c[1] for c in folded}) == 1, calls  # one kernel, both layers
    params = {str(p.name): p for p in after["decode"].params}
    for i, (op, _, call) in enumerate(folded):
        args = list(call.args[1].fields)
        assert op == "relax.call_tir_inplace" and [int(x) for x in call.attrs.inplace_indices] == [0, -1]
        assert args[0].same_as(params[f"cache_{i}"])
        assert [a.same_as(params[n]) for a, n in zip(args[1:4], ("offsets", "starts", "attn_sync"))] == [
            True] * 3
    names = {gv.name_hint for gv in after.functions}
    assert appends[0][1] not in names and "decode_cache_attention0" not in names
    kernel = after[folded[0][1]]
    assert CACHE_ATTENTION_ATTR in kernel.attrs and kernel.attrs["tirx.is_scheduled"]
