"""DeriveKVCache (tvmfuse/llm/kv_cache.py) and its TIR kernels (tvmfuse/llm/kernels.py).

Each R.nn.attention becomes an in-place append of this call's K/V into its layer's caches plus
attention over the cache; the function gains ``offsets, starts, k_cache_i, v_cache_i``. Checked
structurally, against the Before module's numerics (a prefill from slot 0 is the causal attention
itself), and the kernels on llvm against numpy: the append writes only slots
``offsets[b] .. offsets[b] + S - 1`` (below max_seq), the attention reads slots
``min(starts[b], p) .. p`` of query position ``p = offsets[b] + s``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tests.cuda_tools import kernel_bodies, needs_nvcc
from tests.relax_util import apply_pass, run_llvm
from tvmfuse.build.inspect import cuda_source, fatbin_sass
from tvmfuse.build.nvcc import compile_fatbin
from tvmfuse.device_props import device_properties
from tvmfuse.errors import CompileError
from tvmfuse.kernels.attention.flash_decode import (
    TRACE_SLOTS,
    DecodeConfig,
    flash_decode_cache_primfunc,
    pick_config,
    trace_shape,
)
from tvmfuse.kernels.attention.spec import AttentionSpec
from tvmfuse.llm.kernels import CacheSpec, cache_attention, decode_append, kv_append
from tvmfuse.llm.kv_cache import DeriveKVCache
from tvmfuse.options import current_options, use_options
from tvmfuse.targets import get_target
from tvmfuse.tvm_setup import codegen_scope

MAX_SEQ = 16


@I.ir_module
class TwoLayers:
    """Two causal self-attentions (the second reads the first's output as its query)."""

    @R.function
    def main(q: R.Tensor((2, 8, 4, 16), "float32"), k: R.Tensor((2, 8, 4, 16), "float32"),
             v: R.Tensor((2, 8, 4, 16), "float32")) -> R.Tensor((2, 8, 4, 16), "float32"):
        with R.dataflow():
            a = R.nn.attention(q, k, v, causal_mask="TopLeft")
            b = R.nn.attention(a, k, v, causal_mask="BottomRight")
            out = R.add(a, b)
            R.output(out)
        return out


def _calls(func: relax.Function) -> list[tuple[str, relax.Call]]:
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            found.append((e.op.name, e))

    relax.analysis.post_order_visit(func.body, visit)
    return found


def _cache_params_ok(func: relax.Function, batch: int, rows: int = 2 * 4 * MAX_SEQ + 4) -> None:
    names = [str(p.name) for p in func.params]
    assert names == ["q", "k", "v", "offsets", "starts", "cache_0", "cache_1"]
    for p in func.params[5:]:  # one state a layer: K rows, V rows, q rows
        assert [int(d) for d in p.ty.shape.values] == [batch, rows, 16] and p.ty.dtype == "float32"
    for p in func.params[3:5]:
        assert [int(d) for d in p.ty.shape.values] == [batch] and p.ty.dtype == "int32"
    for _, call in _calls(func):
        if call.op.name == "relax.call_tir_inplace":  # writes the state it is given, in place
            assert [int(i) for i in call.attrs.inplace_indices] == [0]


def test_prefill_appends_and_attends_this_calls_keys():
    """S > 1 (a prefill starts its sequences): append in place, then plain causal flash-kernel
    attention over this call's k, v: prompts are right-padded, so no padding mask (no bias: the
    sm_90a wgmma kernel takes it)."""
    after = apply_pass(DeriveKVCache(MAX_SEQ), TwoLayers)
    func = after["main"]
    _cache_params_ok(func, 2)
    calls = _calls(func)
    attention = [c for name, c in calls if name == "relax.nn.attention"]
    names = [name for name, _ in calls]
    assert names.count("relax.call_tir_inplace") == 4 and len(attention) == 2
    assert "relax.nn.attention_bias" not in names and "relax.where" not in names
    for call in attention:
        assert len(call.args) == 3 and str(call.attrs.causal_mask) == "TopLeft"
    prims = [gv.name_hint for gv, f in after.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert sorted(prims) == ["main_k_append0", "main_v_append0"]


@I.ir_module
class TwoLayersDecode:
    @R.function
    def main(q: R.Tensor((2, 1, 4, 16), "float32"), k: R.Tensor((2, 1, 4, 16), "float32"),
             v: R.Tensor((2, 1, 4, 16), "float32")) -> R.Tensor((2, 1, 4, 16), "float32"):
        with R.dataflow():
            a = R.nn.attention(q, k, v, causal_mask="BottomRight")
            b = R.nn.attention(a, k, v, causal_mask="BottomRight")
            out = R.add(a, b)
            R.output(out)
        return out


def test_decode_appends_and_reads_the_cache():
    after = apply_pass(DeriveKVCache(MAX_SEQ), TwoLayersDecode)
    func = after["main"]
    _cache_params_ok(func, 2)
    ops = [name for name, _ in _calls(func)]
    assert "relax.nn.attention" not in ops
    # one append a layer (q, k and v, concatenated over heads) and the attention
    assert ops.count("relax.call_tir_inplace") == 2 and ops.count("relax.call_tir") == 2
    assert ops.count("relax.concat") == 2
    # both layers have the same shapes: one append and one attention kernel shared
    prims = [gv.name_hint for gv, f in after.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert sorted(prims) == ["main_cache_attention0", "main_decode_append0"]


@I.ir_module
class OneLayer:
    @R.function
    def main(q: R.Tensor((2, 8, 4, 16), "float32"), k: R.Tensor((2, 8, 2, 16), "float32"),
             v: R.Tensor((2, 8, 2, 16), "float32")) -> R.Tensor((2, 8, 4, 16), "float32"):
        with R.dataflow():
            a = R.nn.attention(q, k, v, causal_mask="TopLeft")
            R.output(a)
        return a


def test_right_padded_prefill_rows_see_only_real_tokens_before_them():
    """Sequence 1 has 5 real tokens then 3 padding slots (right padding, as the runtime packs a
    prompt batch): its real rows equal causal attention over its first 5 tokens alone (padding
    after a row never reaches it), and every padding row is finite."""
    after = apply_pass(DeriveKVCache(MAX_SEQ), OneLayer)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 8, 4, 16)).astype("float32")
    k, v = (rng.standard_normal((2, 8, 2, 16)).astype("float32") for _ in range(2))
    zeros = np.zeros(2, "int32")
    state = np.zeros((2, 2 * 2 * MAX_SEQ + 4, 16), "float32")
    out = run_llvm(after, q, k, v, zeros, zeros, state)
    # float64 causal attention over sequence 1's first 5 tokens (GQA: head h reads KV head h // 2)
    q5, k5, v5 = (x[1, :5].astype("float64") for x in (q, k, v))
    scores = np.einsum("shd,thd->hst", q5, np.repeat(k5, 2, axis=1)) / 4.0
    scores[:, np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] = -np.inf
    p = np.exp(scores - scores.max(-1, keepdims=True))
    alone = np.einsum("hst,thd->shd", p / p.sum(-1, keepdims=True), np.repeat(v5, 2, axis=1))
    np.testing.assert_allclose(out[1, :5], alone, rtol=1e-5, atol=1e-5)
    assert np.isfinite(out).all()


def test_prefill_from_slot_zero_equals_causal_attention():
    after = apply_pass(DeriveKVCache(MAX_SEQ), TwoLayers)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 8, 4, 16)).astype("float32") for _ in range(3))
    ref = run_llvm(TwoLayers, q, k, v)
    zeros = np.zeros(2, "int32")
    states = [rng.standard_normal((2, 2 * 4 * MAX_SEQ + 4, 16)).astype("float32") for _ in range(2)]
    out = run_llvm(after, q, k, v, zeros, zeros, *states)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@I.ir_module
class NotCausal:
    @R.function
    def main(q: R.Tensor((1, 8, 2, 16), "float32"), k: R.Tensor((1, 8, 2, 16), "float32"),
             v: R.Tensor((1, 8, 2, 16), "float32")) -> R.Tensor((1, 8, 2, 16), "float32"):
        with R.dataflow():
            bidirectional = R.nn.attention(q, k, v)
            R.output(bidirectional)
        return bidirectional


@I.ir_module
class WithBias:
    @R.function
    def main(q: R.Tensor((1, 8, 2, 16), "float32"), k: R.Tensor((1, 8, 2, 16), "float32"),
             v: R.Tensor((1, 8, 2, 16), "float32"),
             bias: R.Tensor((1, 2, 8, 8), "float32")) -> R.Tensor((1, 8, 2, 16), "float32"):
        with R.dataflow():
            biased = R.nn.attention(q, k, v, bias, causal_mask="TopLeft")
            R.output(biased)
        return biased


@I.ir_module
class NoAttention:
    @R.function
    def main(x: R.Tensor((1, 8), "float32")) -> R.Tensor((1, 8), "float32"):
        with R.dataflow():
            y = R.add(x, x)
            R.output(y)
        return y


@pytest.mark.parametrize("mod, message", [
    (NotCausal, "attention at binding 'bidirectional' is not causal self-attention"),
    (WithBias, "attention at binding 'biased' has a bias"),
    (NoAttention, "function 'main' has no attention"),
])
def test_refuses_with_a_compile_error_naming_the_binding(mod, message):
    with pytest.raises(CompileError, match=message):
        apply_pass(DeriveKVCache(MAX_SEQ), mod)


SPEC = CacheSpec(batch=3, seq=4, q_heads=4, kv_heads=2, head_dim=8, max_seq=MAX_SEQ, dtype="float32",
                 scale=0.3)


def _build(prim: tvm.tirx.PrimFunc):
    return tvm.compile(tvm.IRModule({"main": prim.with_attr("global_symbol", "main")}), target="llvm")


def _state(spec: CacheSpec, kc: np.ndarray, vc: np.ndarray, q: np.ndarray | None = None) -> np.ndarray:
    """The state (Bm, R, D) holding caches (Bm, Hkv, M, D) and (decode) the query (Bm, 1, Hq, D)."""
    k0, v0, q0, rows = spec.rows
    B, Hkv, M, D = spec.cache_shape
    state = np.zeros((B, rows, D), kc.dtype)
    state[:, k0:k0 + Hkv * M] = kc.reshape(B, Hkv * M, D)
    state[:, v0:v0 + Hkv * M] = vc.reshape(B, Hkv * M, D)
    if q is not None:
        state[:, q0:] = q.reshape(B, spec.q_heads, D)
    return state


def _caches(spec: CacheSpec, state: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(K, V, q rows) of a state, inverse of :func:`_state`."""
    k0, v0, q0, _ = spec.rows
    B, Hkv, M, D = spec.cache_shape
    return (state[:, k0:k0 + Hkv * M].reshape(spec.cache_shape),
            state[:, v0:v0 + Hkv * M].reshape(spec.cache_shape), state[:, q0:])


def test_append_writes_only_the_new_slots():
    """Prefill: offsets 0, 5 and 14 (the last one runs past max_seq: slots 14, 15 written, 2
    dropped), keys into the K rows, values into the V rows; nothing else of the state changes."""
    rng = np.random.default_rng(1)
    kc, vc = (rng.standard_normal(SPEC.cache_shape).astype("float32") for _ in range(2))
    state = _state(SPEC, kc, vc, rng.standard_normal((3, 1, 4, 8)).astype("float32"))
    k, v = (rng.standard_normal(SPEC.kv_shape).astype("float32") for _ in range(2))
    offsets = np.array([0, 5, 14], "int32")
    args = [tvm.runtime.tensor(a) for a in (state, k, offsets)]
    _build(kv_append(SPEC, 0))(*args)
    _build(kv_append(SPEC, 1))(args[0], tvm.runtime.tensor(v), args[2])
    ref_k, ref_v = kc.copy(), vc.copy()
    for b, off in enumerate(offsets):
        for s in range(SPEC.seq):
            if off + s < MAX_SEQ:
                ref_k[b, :, off + s] = k[b, s]
                ref_v[b, :, off + s] = v[b, s]
    got_k, got_v, got_q = _caches(SPEC, args[0].numpy())
    np.testing.assert_array_equal(got_k, ref_k)
    np.testing.assert_array_equal(got_v, ref_v)
    np.testing.assert_array_equal(got_q, state[:, SPEC.rows[2]:])
    assert not np.array_equal(ref_k, kc)  # something was written


SPEC1 = dataclasses.replace(SPEC, seq=1)


def test_decode_append_writes_the_query_and_one_slot():
    """Decode: x = concat(q, k, v) over heads → the q rows, and slot offsets[b] of K and V (14;
    16 is past the cache: only q is written for that row)."""
    rng = np.random.default_rng(4)
    kc, vc = (rng.standard_normal(SPEC1.cache_shape).astype("float32") for _ in range(2))
    state = _state(SPEC1, kc, vc, np.zeros((3, 1, 4, 8), "float32"))
    x = rng.standard_normal((3, 1, 4 + 2 * 2, 8)).astype("float32")
    offsets = np.array([0, 14, 16], "int32")
    args = [tvm.runtime.tensor(a) for a in (state, x, offsets)]
    _build(decode_append(SPEC1))(*args)
    ref_k, ref_v = kc.copy(), vc.copy()
    for b, off in enumerate(offsets):
        if off < MAX_SEQ:
            ref_k[b, :, off] = x[b, 0, 4:6]
            ref_v[b, :, off] = x[b, 0, 6:8]
    got_k, got_v, got_q = _caches(SPEC1, args[0].numpy())
    np.testing.assert_array_equal(got_q, x[:, 0, :4])
    np.testing.assert_array_equal(got_k, ref_k)
    np.testing.assert_array_equal(got_v, ref_v)


def _cache_attention_ref(spec: CacheSpec, q, kc, vc, offsets, starts) -> np.ndarray:
    """float64 numpy: row (b, h) attends slots min(starts[b], p) .. p, p = min(offsets[b], M-1)."""
    q, kc, vc = (a.astype("float64") for a in (q, kc, vc))
    ref = np.zeros(spec.q_shape)
    group = spec.q_heads // spec.kv_heads
    for b in range(spec.batch):
        p = min(offsets[b], spec.max_seq - 1)
        lo = min(starts[b], p)
        for h in range(spec.q_heads):
            keys, vals = kc[b, h // group, lo:p + 1], vc[b, h // group, lo:p + 1]
            scores = spec.scale * keys @ q[b, 0, h]
            w = np.exp(scores - scores.max())
            ref[b, 0, h] = (w / w.sum()) @ vals
    return ref


def _cache_attention_case(spec: CacheSpec, offsets, starts, seed: int):
    """(state, offsets, starts) with random caches and query, and the float64 result."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(spec.q_shape).astype(spec.dtype)
    kc, vc = (rng.standard_normal(spec.cache_shape).astype(spec.dtype) for _ in range(2))
    offsets, starts = np.array(offsets, "int32"), np.array(starts, "int32")
    return ((_state(spec, kc, vc, q), offsets, starts),
            _cache_attention_ref(spec, q, kc, vc, offsets, starts))


def test_cache_attention_reads_the_visible_slots():
    """GQA (2 query heads per KV head), per-sequence offsets and starts (left padding); this
    step's query from the state's q rows."""
    args, ref = _cache_attention_case(SPEC1, [0, 6, 11], [0, 3, 9], seed=2)
    out = tvm.runtime.empty(SPEC1.q_shape, "float32")
    _build(cache_attention(SPEC1))(*[tvm.runtime.tensor(a) for a in args], out)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)


# decode on CUDA: the split-KV kernel over the cache (1000 slots: chunks past p stay empty)
DECODE = CacheSpec(batch=4, seq=1, q_heads=8, kv_heads=2, head_dim=128, max_seq=1000,
                   dtype="float16", scale=128 ** -0.5)
DECODE_ROWS = ([0, 700, 999, 1500], [0, 100, 999, 5])  # offsets (1500: past the end), starts


VARIANTS = [(False, False), (True, False), (False, True), (True, True)]
VARIANT_IDS = ["two_kernels", "fused_combine", "two_kernels_prefetch", "fused_prefetch"]


@needs_nvcc
@pytest.mark.parametrize("fused, prefetch", VARIANTS, ids=VARIANT_IDS)
def test_cuda_decode_reads_the_cache_with_the_split_kv_kernel(tmp_path, fused, prefetch):
    """The CUDA decode kernel is the flash-decoding one over the state (16-byte loads of the
    cache); its combine a second kernel, or in the same launch (the last block of a head row
    counts itself in ``sync`` with an atomic and combines); nvcc builds it for sm_80 and sm_90a
    without spills. With ``l2_prefetch`` (sm_90 only: PDL) the partial kernel's only accesses
    before its ``griddepcontrol.wait`` are the offsets/starts and two bulk L2 prefetches."""
    prim = cache_attention(DECODE, cuda=True, fused_combine=fused, l2_prefetch=prefetch)
    assert [str(p.name) for p in prim.params] == ["state", "offsets", "starts", "sync", "out"]
    assert [int(d) for d in prim.params[3].ty.shape] == list(DECODE.sync_shape)
    for name in ("sm90",) if prefetch else ("sm80", "sm90"):
        spec = get_target(name)
        with codegen_scope():
            source = cuda_source(tvm.compile(tvm.IRModule({"main": prim.with_attr(
                "global_symbol", "main")}), target=spec.tvm_target()))
        kernels = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))
        assert len(kernels) == (1 if fused else 2), kernels
        bodies = kernel_bodies(source)
        params, partial = bodies["main_kernel"]
        assert ("griddepcontrol_wait" in partial) == prefetch
        assert all("griddepcontrol" not in body for _, body in bodies.values() if body != partial)
        if prefetch:  # before the wait: offsets/starts and the two prefetches of the state
            before = partial[: partial.index("griddepcontrol_wait")]
            assert before.count("prefetch_L2_global(") == 2, before
            rest = re.sub(r"prefetch_L2_global\(\(&\(state\w*\[", "", before)
            read = {p for p in params if re.search(rf"\b{p}\[", rest)}
            assert read and read <= {"offsets_ptr", "starts_ptr"}, (read, before)
        sass = fatbin_sass(compile_fatbin(source, spec, tmp_path))
        text = next(t for arch, t in sass.items() if arch.startswith("sm_"))
        assert "LDG.E.128" in text
        has_atomic = re.search(r"\b(ATOM|ATOMG|RED)\.", text) is not None
        assert has_atomic == fused and ("MEMBAR" in text) == fused
        log = (tmp_path / "kernels.ptxas.log").read_text()
        assert all(n == "0" for n in re.findall(r"(\d+) bytes spill stores", log)), log


# (l2_prefetch, pipeline) with preload: registers before the wait, with and without L2 for the rest
PRELOAD = [(True, False), (False, False), (True, True)]
PRELOAD_IDS = ["with_l2", "registers_only", "pipelined"]


def _preloaded(spec: CacheSpec, l2: bool, piped: bool) -> tvm.tirx.PrimFunc:
    config = DecodeConfig(unroll=4 if piped else 8, pipeline=piped, l2_prefetch=l2, preload=True)
    return flash_decode_cache_primfunc(spec.attention_spec(), config=config).with_attr(
        "global_symbol", "main")


@needs_nvcc
@pytest.mark.parametrize("l2, piped", PRELOAD, ids=PRELOAD_IDS)
def test_cuda_decode_preload_loads_first_keys_before_the_wait(tmp_path, l2, piped):
    """``DecodeConfig.preload``: before its ``griddepcontrol.wait`` the partial kernel reads only
    offsets/starts and the state (16-byte loads into the key/value registers, and with
    ``l2_prefetch`` two bulk prefetches of the rows after them); after the wait it loads the newest
    slot's rows again, under a guard, before the first scores; nvcc: no spills."""
    target = get_target("sm90")
    with codegen_scope():
        source = cuda_source(tvm.compile(tvm.IRModule({"main": _preloaded(DECODE, l2, piped)}),
                                         target=target.tvm_target()))
    params, partial = kernel_bodies(source)["main_kernel"]
    before, after = partial.split("griddepcontrol_wait();", 1)
    loads = re.findall(r"\*\(uint4\*\)\((\w+)_ptr \+ \d+\) = \*\(uint4\*\)\((\w+)", before)
    assert loads and {dst for dst, _ in loads} == {"kr", "vr"} and {src for _, src in loads} == {
        "state_ptr"}, before
    assert len(loads) == 2 * (4 if piped else 8)  # one key and one value row per unrolled step
    assert before.count("prefetch_L2_global(") == (2 if l2 else 0)
    rest = re.sub(r"prefetch_L2_global\(\(&\(state\w*\[|\(uint4\*\)\(state_ptr", "", before)
    assert {p for p in params if re.search(rf"\b{p}\[", rest)} <= {"offsets_ptr", "starts_ptr"}
    # the reload: guarded 16-byte loads of the same registers right after the wait, before q
    reload = after[: after.index("qr_ptr[")]
    assert "if (" in reload and "*(uint4*)(kr_ptr" in reload and "*(uint4*)(vr_ptr" in reload
    sass = fatbin_sass(compile_fatbin(source, target, tmp_path))
    text = next(t for arch, t in sass.items() if arch.startswith("sm_"))
    assert "LDG.E.128" in text and "STL" not in text
    log = (tmp_path / "kernels.ptxas.log").read_text()
    assert all(n == "0" for n in re.findall(r"(\d+) bytes spill stores", log)), log


def test_decode_preload_stays_out_of_the_folded_kernel():
    """The kernel with the append inside writes the newest slot itself: ``preload`` leaves its
    source as without it (its own first-iteration loads stay)."""
    spec = DECODE.attention_spec()

    def src(cfg: DecodeConfig) -> str:
        with codegen_scope():
            return cuda_source(tvm.compile(tvm.IRModule({"main": flash_decode_cache_primfunc(
                spec, config=cfg).with_attr("global_symbol", "main")}),
                target=get_target("sm90").tvm_target()))

    assert src(DecodeConfig(l2_prefetch=True, preload=True)) != src(DecodeConfig(l2_prefetch=True))
    assert src(DecodeConfig(preload=True)).count("griddepcontrol_wait();") == 1


def test_decode_trace_records_each_stage_in_its_own_buffer():
    """``DecodeConfig.trace`` adds a sixth parameter that thread 0 of each block writes: one
    stamp a slot of ``TRACE_SLOTS`` (the cluster config has every stage), a row per block; without
    it the kernel keeps its five parameters and no stamp."""
    spec = DECODE.attention_spec()
    cfg = DecodeConfig(cluster=True, threads=256, trace=True)
    traced = flash_decode_cache_primfunc(spec, config=cfg)
    assert [p.name for p in traced.params][-1] == "trace"
    assert len(traced.params) == 6
    trace = traced.params[-1]
    sms = device_properties(None).sms
    assert (trace.dtype, tuple(trace.shape)) == ("uint64", trace_shape(spec, cfg, sms))
    with codegen_scope():
        src = cuda_source(tvm.compile(tvm.IRModule({"main": traced.with_attr("global_symbol", "main")}),
                                      target=get_target("sm90").tvm_target()))
    stores = re.findall(r"trace_ptr\[[^\]]*\] = (\w+)\(\);", src)
    assert stores == ["tvmfuse_globaltimer", "tvmfuse_smid"] + ["tvm_builtin_clock64"] * 8 + [
        "tvmfuse_globaltimer"]
    assert len(stores) == len(TRACE_SLOTS)
    plain = flash_decode_cache_primfunc(spec, config=dataclasses.replace(cfg, trace=False))
    assert len(plain.params) == 5
    assert "trace" not in plain.script()


def _thread_extent(prim: tvm.tirx.PrimFunc, tag: str) -> int:
    return int(re.search(rf'launch_thread\("{re.escape(tag)}", (\d+)\)', prim.script()).group(1))


@pytest.mark.parametrize("heads, rows", [(0, 2), (4, 2), (3, 4), (2, 4), (1, 8)])
def test_decode_heads_split_a_kv_head_over_more_blocks(heads, rows):
    """``DecodeConfig.heads``: a block takes the largest divisor of G (4 here) up to ``heads``
    query heads, so a KV head's chunks run in G / that block rows (blockIdx.y = Hkv · HC); the
    fused combine's counters are allocated for the most rows any config has (B · Hq)."""
    spec = DECODE.attention_spec()
    prim = flash_decode_cache_primfunc(spec, config=DecodeConfig(heads=heads, fused_combine=True))
    assert _thread_extent(prim, "blockIdx.y") == rows
    assert [int(d) for d in prim.params[3].shape] == [DECODE.batch * DECODE.q_heads]


MHA_DECODE = dataclasses.replace(DECODE, q_heads=8, kv_heads=8)  # one query head a block (GC = 1)


def _clustered(spec: CacheSpec, threads: int = 128, l2: bool = False, piped: bool = False,
               splits: int = 0, unroll: int = 8) -> tvm.tirx.PrimFunc:
    config = DecodeConfig(unroll=4 if piped else unroll, pipeline=piped, l2_prefetch=l2,
                          cluster=True, threads=threads, splits=splits)
    return flash_decode_cache_primfunc(spec.attention_spec(), config=config).with_attr(
        "global_symbol", "main")


CLUSTER = [(128, False, False), (256, True, False), (128, True, True)]
CLUSTER_IDS = ["threads128", "threads256_l2", "pipelined_l2"]


@needs_nvcc
@pytest.mark.parametrize("threads, l2, piped", CLUSTER, ids=CLUSTER_IDS)
def test_cuda_decode_cluster_combines_in_one_launch(tmp_path, threads, l2, piped):
    """``DecodeConfig.cluster``: one kernel, launched as clusters of the n_split chunks
    (``clusterCtaIdx.x`` among its launch tags), no float32 partials in global memory; after a
    cluster barrier each block merges its share of the outputs from every peer's shared memory
    (3 distributed shared-memory loads a peer: m, l and the partial sum), and a second (relaxed)
    barrier keeps every block resident until its peers have read it; no atomics, no spills."""
    from tvmfuse.build.inspect import launch_tags
    from tvmfuse.kernels.attention.flash_decode import _chunks

    prim = _clustered(DECODE, threads, l2, piped)
    n_split, _, _ = _chunks(DECODE.attention_spec(), DecodeConfig(
        unroll=4 if piped else 8, pipeline=piped, cluster=True, threads=threads), 132)
    assert 1 < n_split <= 16
    target = get_target("sm90")
    with codegen_scope():
        lib = tvm.compile(tvm.IRModule({"main": prim}), target=target.tvm_target())
    source = cuda_source(lib)
    assert list(kernel_bodies(source)) == ["main_kernel"]
    assert "part_o" not in source and "TVMBackendAllocWorkspace" not in str(lib.mod.inspect_source())
    assert source.count("tvm_builtin_ptx_ld_shared__cluster_f32(") - 1 == 3 * n_split
    lib.export_library(str(tmp_path / "m.so"))
    assert launch_tags(tmp_path / "m.so")["main_kernel"] == [
        "blockIdx.x", "clusterCtaIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x"]
    sass = fatbin_sass(compile_fatbin(source, target, tmp_path))
    text = next(t for arch, t in sass.items() if arch.startswith("sm_"))
    assert "LDG.E.128" in text and "STL" not in text
    assert text.count("UCGABAR_ARV") == 2 and text.count("UCGABAR_WAIT") == 2
    assert re.search(r"\b(ATOM|ATOMG|RED)\.", text) is None
    log = (tmp_path / "kernels.ptxas.log").read_text()
    assert all(n == "0" for n in re.findall(r"(\d+) bytes spill stores", log)), log


def test_decode_cluster_keeps_its_chunks_within_one_cluster():
    """With ``cluster`` the chunk count is capped at 16 CTAs (the non-portable cluster size) and
    is not reduced by rounding chunks to whole iterations (the cache's chunk length follows the
    visible slots at run time); it takes neither the atomic combine nor the append inside."""
    from tvmfuse.kernels.attention.flash_decode import NewToken, _chunks

    lm4 = AttentionSpec(1, 1, 2081, 16, 4, 128, "float16", 128 ** -0.5)
    assert _chunks(lm4, DecodeConfig(cluster=True), 132)[0] == 16
    assert _chunks(lm4, DecodeConfig(cluster=True, threads=256), 132)[0] == 16
    assert _chunks(lm4, DecodeConfig(), 132)[0] == 33  # the default: ~2 blocks an SM, 64 keys each
    b8 = AttentionSpec(8, 1, 1057, 32, 32, 128, "float16", 128 ** -0.5)
    assert _chunks(b8, DecodeConfig(cluster=True), 132)[0] == 2
    with pytest.raises(ValueError, match="cluster"):
        flash_decode_cache_primfunc(lm4, config=DecodeConfig(cluster=True, fused_combine=True))
    with pytest.raises(ValueError, match="cluster"):
        flash_decode_cache_primfunc(lm4, config=DecodeConfig(cluster=True),
                                    new_token=NewToken(lambda b, h, d: tvm.tirx.const(0, "float16")))
    with pytest.raises(ValueError, match="threads"):
        flash_decode_cache_primfunc(lm4, config=DecodeConfig(threads=200))
    gc8 = AttentionSpec(1, 1, 2081, 32, 4, 128, "float16", 128 ** -0.5)  # 8 query heads a block
    with pytest.raises(ValueError, match="shared memory"):  # 16 lane groups x 8 heads x 128 floats
        flash_decode_cache_primfunc(gc8, config=DecodeConfig(cluster=True, threads=256))


@pytest.mark.parametrize("batch, slots, q_heads, kv_heads, cluster, want", [
    (1, 2081, 16, 4, True, (True, 256, 9, 2)),  # lm4: 16 chunks x 16 rows x 9 cover 2081 slots
    (1, 2081, 16, 4, False, (False, 128, 8, 0)),
    # G = 8 spread to 4 heads a block (4 heads: 32 KiB of merge buffer at 256 threads)
    (4, 1000, 16, 2, True, (True, 256, 8, 4)),
    (1, 2081, 32, 4, True, (True, 256, 9, 4)),
    (1, 4096, 8, 1, True, (False, 128, 8, 0)),  # one KV head: 64 chunks without the cluster
])
def test_decode_config_threads_and_unroll_follow_the_cluster(batch, slots, q_heads, kv_heads,
                                                             cluster, want):
    """``pick_config`` with ``threads`` 0: 256 threads with the cluster where a block merges ≤ 4
    query heads, else 128; with the cluster the unroll rises to one iteration a block where that
    is ≤ 10 rows a lane group and ≤ 40 scores a lane; the cluster is dropped where its ≤ 16
    chunks would give each lane group more than 1.25× the rows of the two-kernel config; and with
    the cluster a block's query heads halve while twice the blocks still fit on the 132 SMs."""
    spec = AttentionSpec(batch, 1, slots, q_heads, kv_heads, 128, "float16", 128 ** -0.5)
    cfg = pick_config(spec, 132, l2_prefetch=True, cluster=cluster)
    assert (cfg.cluster, cfg.threads, cfg.unroll, cfg.heads, cfg.pipeline) == (*want, False)
    assert pick_config(spec, 132, cluster=cluster, threads=64).threads == 64  # an explicit count


def _pipelined(spec: CacheSpec, fused: bool = False) -> tvm.tirx.PrimFunc:
    return flash_decode_cache_primfunc(spec.attention_spec(), config=DecodeConfig(
        pipeline=True, fused_combine=fused)).with_attr("global_symbol", "main")


@needs_nvcc
@pytest.mark.parametrize("spec", [DECODE, MHA_DECODE], ids=["gqa", "mha"])
def test_cuda_decode_pipelined_builds_without_spills(spec, tmp_path):
    """``DecodeConfig(pipeline=True)`` (a second register set of keys and values): nvcc builds it
    for sm_90a with 16-byte loads and no local memory, for 4 query heads a block and for 1."""
    target = get_target("sm90")
    with codegen_scope():
        source = cuda_source(tvm.compile(tvm.IRModule({"main": _pipelined(spec)}),
                                         target=target.tvm_target()))
    sass = fatbin_sass(compile_fatbin(source, target, tmp_path))
    text = next(t for arch, t in sass.items() if arch.startswith("sm_"))
    assert "LDG.E.128" in text and "STL" not in text
    log = (tmp_path / "kernels.ptxas.log").read_text()
    assert all(n == "0" for n in re.findall(r"(\d+) bytes spill stores", log)), log


@pytest.mark.parametrize("batch, q_heads, kv_heads, slots, piped", [
    (8, 32, 32, 1057, True),  # the 7B at batch 8: 2 chunks, 17 iterations a block
    (1, 32, 32, 1057, False),  # batch 1: 9 chunks, 4 iterations
    (1, 16, 4, 2081, False),  # the 4-layer LM: 33 chunks, 2 iterations
    (2, 32, 32, 1057, False)])
def test_decode_config_pipelines_long_chunks(batch, q_heads, kv_heads, slots, piped):
    """``pick_config``: unroll 4 with the pipeline where each block loops ≥ 8 iterations, the
    default (unroll 8) elsewhere; the flags pass through."""
    spec = AttentionSpec(batch, 1, slots, q_heads, kv_heads, 128, "float16", 128 ** -0.5)
    cfg = pick_config(spec, 132, fused_combine=True)
    assert cfg.fused_combine and not cfg.l2_prefetch
    assert (cfg.pipeline, cfg.unroll) == ((True, 4) if piped else (False, 8))


def test_cuda_decode_takes_one_counter_buffer_for_every_layer():
    """On CUDA every entry point gains ``attn_sync`` after the caches (the decode kernels' counters;
    one buffer: the layers' kernels run one after another), and each decode attention reads it."""
    decode = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([2, 1, 4, 128], "float16"))
    with decode.function("main", [q]):
        with decode.dataflow():
            a = decode.emit(relax.op.nn.attention(q, q, q, causal_mask="BottomRight"))
            b = decode.emit(relax.op.nn.attention(a, q, q, causal_mask="BottomRight"))
            out = decode.emit_output(b)
        decode.emit_func_output(out)
    after = DeriveKVCache(MAX_SEQ, cuda=True)(decode.get())["main"]
    names = [str(p.name) for p in after.params]
    assert names[-1] == "attn_sync" and names.count("attn_sync") == 1
    sync = after.params[-1]
    spec = CacheSpec(batch=2, seq=1, q_heads=4, kv_heads=4, head_dim=128, max_seq=MAX_SEQ,
                     dtype="float16", scale=1.0)
    assert [int(d) for d in sync.ty.shape.values] == list(spec.sync_shape) and sync.ty.dtype == "int32"
    attn = [c for n, c in _calls(after) if n == "relax.call_tir" and len(c.args[1].fields) == 4]
    assert len(attn) == 2 and all(c.args[1].fields[3].same_as(sync) for c in attn)
    # the cpu target's kernels need no counters
    assert "attn_sync" not in [str(p.name) for p in DeriveKVCache(MAX_SEQ)(decode.get())["main"].params]


def _decode_config(pdl: bool, clusters: bool = False, **options) -> dict:
    """The decode attention's config that DeriveKVCache picks under ``options``."""
    import json

    from tvmfuse.attrs import CACHE_ATTENTION_ATTR

    decode = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([1, 1, 8, 128], "float16"))
    k = relax.Var("k", relax.TensorType([1, 1, 2, 128], "float16"))
    with decode.function("main", [q, k]):
        with decode.dataflow():
            out = decode.emit_output(relax.op.nn.attention(q, k, k, causal_mask="BottomRight"))
        decode.emit_func_output(out)
    with use_options(dataclasses.replace(current_options(), **options)):
        after = DeriveKVCache(MAX_SEQ, cuda=True, pdl=pdl, clusters=clusters)(decode.get())
    metas = [json.loads(str(f.attrs[CACHE_ATTENTION_ATTR])) for _, f in after.functions.items()
             if f.attrs is not None and CACHE_ATTENTION_ATTR in f.attrs]
    assert len(metas) == 1
    return metas[0]["config"]


@pytest.mark.parametrize("pdl, option, want", [(True, True, True), (True, False, False),
                                                (False, True, False)])
def test_decode_preload_follows_the_option_under_programmatic_launch(pdl, option, want):
    """``Options.decode_preload_kv`` reaches the decode attention's config only where the decode
    kernels launch programmatically (without PDL nothing runs before a wait); the L2 prefetch
    keeps its own rule (PDL and a cache under ``decode_kv_prefetch_bytes``)."""
    config = _decode_config(pdl, decode_preload_kv=option)
    assert config["preload"] == want
    assert config["l2_prefetch"] == pdl


@pytest.mark.parametrize("threads, cluster", [(200, "off"), (512, "pdl")],
                         ids=["not_whole_warps", "shared_memory"])
def test_decode_attention_threads_it_cannot_take_name_the_option(threads, cluster):
    """A thread count the split-KV kernel cannot take (not whole warps; a merge buffer past 48 KiB
    of shared memory: 512 threads with all 4 query heads of a KV head a block) stops compile_lm's
    cache derivation with a CompileError that names the decode attention, its heads and
    ``Options.decode_attention_threads``."""
    with pytest.raises(CompileError, match=r"decode attention 'main_cache_attention0' \(8 q / 2 KV "
                       r"heads, head_dim 128\) with Options.decode_attention_threads=" + str(threads)):
        _decode_config(True, True, decode_attention_threads=threads, decode_cluster_combine=cluster,
                       decode_attention_heads=4)


@pytest.mark.parametrize("mode, pdl, clusters, want, threads", [
    ("pdl", True, True, True, 256), ("pdl", False, True, False, 128), ("on", False, True, True, 256),
    ("on", True, False, False, 128), ("off", True, True, False, 128)])
def test_decode_cluster_combine_follows_its_mode(mode, pdl, clusters, want, threads):
    """``Options.decode_cluster_combine``: "pdl" (default) where the decode step launches
    programmatically, "on" on every target with thread-block clusters (sm_90), "off" never; the
    split-KV kernel takes 256 threads with the cluster, 128 without (``decode_attention_threads``
    0), and an explicit thread count wins."""
    config = _decode_config(pdl, clusters, decode_cluster_combine=mode)
    assert (config["cluster"], config["threads"]) == (want, threads)
    assert _decode_config(pdl, clusters, decode_cluster_combine=mode,
                          decode_attention_threads=64)["threads"] == 64
    from tvmfuse.errors import InputSpecError

    with pytest.raises(InputSpecError, match="decode_cluster_combine"):
        dataclasses.replace(current_options(), decode_cluster_combine="yes")


@needs_nvcc
def test_cuda_prefill_append_moves_16_bytes_a_thread(tmp_path):
    """The CUDA prefill append is the vectorised kernel (the generic rule wrote one 2-byte element
    a thread): 128-bit loads of x and stores into the cache rows, one guard on the slot."""
    spec = CacheSpec(batch=2, seq=16, q_heads=4, kv_heads=2, head_dim=64, max_seq=40,
                     dtype="float16", scale=0.125)
    func = kv_append(spec, 1, cuda=True)
    assert func.attrs["tirx.is_scheduled"] and int(func.attrs["op_pattern"]) == 8
    target = get_target("sm90")
    with codegen_scope():
        source = cuda_source(tvm.compile(tvm.IRModule({"main": func.with_attr(
            "global_symbol", "main")}), target=target.tvm_target()))
    sass = fatbin_sass(compile_fatbin(source, target, tmp_path))
    text = next(t for arch, t in sass.items() if arch.startswith("sm_"))
    assert "LDG.E.128" in text and "STG.E.128" in text


def _check_on_gpu(prim: tvm.tirx.PrimFunc, spec: CacheSpec, seeds=(3, 4)) -> None:
    """``prim`` built for sm_90a against float64 numpy at offsets 0, 700, 999 and past the end,
    one call per seed on the same counters, which every call must leave at zero."""
    dev = tvm.cuda()
    lib = tvm.compile(tvm.IRModule({"main": prim}), target=get_target("sm90").tvm_target())
    sync = tvm.runtime.tensor(np.zeros(spec.sync_shape, "int32"), dev)
    for seed in seeds:
        args, ref = _cache_attention_case(spec, *DECODE_ROWS, seed=seed)
        out = tvm.runtime.empty(spec.q_shape, "float16", dev)
        lib(*[tvm.runtime.tensor(a, dev) for a in args], sync, out)
        err = np.linalg.norm(out.numpy().astype("float64") - ref) / np.linalg.norm(ref)
        assert err < 2e-3, (seed, err)
        assert not sync.numpy().any(), sync.numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("fused, prefetch", VARIANTS, ids=VARIANT_IDS)
def test_cuda_decode_numerics_on_the_gpu(fused, prefetch):
    """H200: the decode kernel against float64 numpy for offsets 0, 700, 999, past the end; three
    calls on the same counters (each call leaves them at zero for the next). The prefetching
    variant launched plainly (its ``griddepcontrol.wait`` returns at once)."""
    prim = cache_attention(DECODE, cuda=True, fused_combine=fused, l2_prefetch=prefetch)
    _check_on_gpu(prim.with_attr("global_symbol", "main"), DECODE, seeds=(3, 4, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("l2, piped", PRELOAD, ids=PRELOAD_IDS)
def test_cuda_decode_preload_numerics_on_the_gpu(l2, piped):
    """The preloading kernel against float64 numpy (offsets 0, 700, 999, past the end), launched
    plainly: its wait returns at once, so this checks the indexing of the preload and reload (the
    ordering against the append is the sm90 ``generate`` test's, under PDL)."""
    _check_on_gpu(_preloaded(DECODE, l2, piped), DECODE)


@pytest.mark.gpu
@pytest.mark.parametrize("combine, threads", [("kernel", 128), ("fused", 128), ("cluster", 256),
                                             ("cluster", 512)])
@pytest.mark.parametrize("heads", [1, 2])
def test_cuda_decode_head_split_numerics_on_the_gpu(combine, threads, heads):
    """Fewer query heads a block (``DecodeConfig.heads``) against float64 numpy with each
    combine (offsets 0, 700, 999, past the end), launched plainly; 512 threads (32 lane groups,
    whose shared merge buffer fits only at ≤ 2 heads a block) with the cluster."""
    config = DecodeConfig(heads=heads, fused_combine=combine == "fused",
                          cluster=combine == "cluster", threads=threads)
    prim = flash_decode_cache_primfunc(DECODE.attention_spec(), config=config)
    _check_on_gpu(prim.with_attr("global_symbol", "main"), DECODE, seeds=(8,))


@pytest.mark.gpu
@pytest.mark.parametrize("threads, l2, piped", CLUSTER, ids=CLUSTER_IDS)
@pytest.mark.parametrize("spec", [DECODE, MHA_DECODE], ids=["gqa", "mha"])
def test_cuda_decode_cluster_numerics_on_the_gpu(spec, threads, l2, piped):
    """The cluster combine against float64 numpy (offsets 0, 700, 999, past the end: clusters
    whose chunks are mostly empty, and full ones), launched plainly; also at 3 chunks (a cluster
    size that is not a power of two)."""
    _check_on_gpu(_clustered(spec, threads, l2, piped), spec)
    _check_on_gpu(_clustered(spec, threads, l2, piped, splits=3), spec, seeds=(6,))
    if not piped:  # 9 rows a lane group (pick_config's one-iteration unroll for the 4-layer LM)
        _check_on_gpu(_clustered(spec, threads, l2, unroll=9), spec, seeds=(7,))


@pytest.mark.gpu
@pytest.mark.parametrize("heads, want", [(0, (True, 256, 8, 4)), (8, (True, 128, 8, 8))])
def test_cuda_decode_cluster_numerics_eight_heads_a_kv_head(heads, want):
    """The cluster kernel as ``pick_config`` builds it for 8 query heads a KV head: by default
    4 of them a block (``_spread_heads``) at 256 threads; with all 8 (GC = 8) 128 threads, unroll
    8 (ptxas spills a few bytes there, as the two-kernel default does)."""
    spec = dataclasses.replace(DECODE, q_heads=16, kv_heads=2)
    config = pick_config(spec.attention_spec(), 132, l2_prefetch=True, cluster=True, heads=heads)
    assert (config.cluster, config.threads, config.unroll, config.heads) == want
    _check_on_gpu(flash_decode_cache_primfunc(spec.attention_spec(), config=config).with_attr(
        "global_symbol", "main"), spec)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [DECODE, MHA_DECODE], ids=["gqa", "mha"])
@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused_combine"])
def test_cuda_decode_pipelined_numerics_on_the_gpu(spec, fused):
    """H200: the pipelined variant against float64 numpy (offsets 0, 700, 999, past the end: chunks
    of 0, 1 and several iterations, odd and even counts)."""
    _check_on_gpu(_pipelined(spec, fused), spec)
