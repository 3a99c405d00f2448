"""The decode append made by the QKV GEMV's epilogue (rules/gemv_append.py,
``Options.decode_gemv_append``).

CPU: which row order :func:`gather_for` picks (or why none), the gather's stores against the
append PrimFunc itself on llvm (an emulation of the kernel's blocks: each block's outputs in a
buffer of its own, every store made from there), and the compiled sm90 decode step: no append
kernel, the GEMV writes the cache, nvcc builds it without spills. GPU numerics:
test_llm_compile_lm's ``test_sm90_generate_on_the_gpu[gemv_append]``."""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest
import torch
import tvm
from tvm import tirx
from tvm.script import tirx as T

from tests.cuda_tools import kernel_sass, needs_nvcc
from tests.lm_reference import tiny_llama
from tvmfuse.attrs import STEP_INPUTS_ATTR
from tvmfuse.kernels.gemm.gemv import RowGather, _block_output, _early_value
from tvmfuse.kernels.index_eval import value as _value
from tvmfuse.options import current_options, use_options
from tvmfuse.rules import gemv as gemv_rule
from tvmfuse.rules import gemv_append
from tvmfuse.rules.gemv_append import AppendSite, gather_for

pytest.importorskip("transformers")

import tvmfuse  # noqa: E402
from tvmfuse.build.inspect import cuda_source  # noqa: E402

M, HEADS, D = 2, 4, 16
N = HEADS * D


def _append(pairing: str) -> tvm.tirx.PrimFunc:
    """A decode append of M rows × HEADS heads of D into ``state`` (M, HEADS, D): the point
    (b, h, d) stores ``x[b, h·D + d] · c[d] + x[b, partner] · s[d]``, partner d ± D/2
    ("rotate_half") or d xor 1 ("interleaved"), or ("data") ``x[b, keep[b] mod N] · c[d]``; the
    store skipped where ``keep[b]`` is 0."""
    half = D // 2

    def value(x, c, s, keep, b, h, d):
        if pairing == "data":
            return x[b, T.Cast("int64", keep[b]) % N] * c[d]
        if pairing == "rotate_half":
            partner = h * D + T.if_then_else(d < half, d + half, d - half)
        else:
            partner = h * D + d // 2 * 2 + (1 - d % 2)
        return x[b, h * D + d] * c[d] + x[b, partner] * s[d]

    @T.prim_func(s_tir=True)
    def append(x: T.Buffer((M, N), "float16"), c: T.Buffer((D,), "float16"),
               s: T.Buffer((D,), "float16"), keep: T.Buffer((M,), "int32"),
               state: T.Buffer((M, HEADS, D), "float16")):
        for b, q, h, d in T.grid(M, 1, HEADS, D):
            with T.sblock("append"):
                vb, vq, vh, vd = T.axis.remap("SSSS", [b, q, h, d])
                if keep[vb] > 0:
                    state[vb, vh, vd] = value(x, c, s, keep, vb, vh, vd)

    return append


_SITE = AppendSite(call=None, qkv=0, state=4)
_J = tirx.Var("j", "int32")


def _emulation(afunc: tvm.tirx.PrimFunc, site: AppendSite, gather: RowGather, m: int, n: int,
               rows: int) -> tvm.tirx.PrimFunc:
    """``(y, append's params but the GEMV output)``: the gather kernel's stores, block by block
    on llvm (each block's outputs y[m, row_of(j)] in a buffer of its own, as the kernel's
    shared memory; the early loads into buffers of their own before each store)."""
    y = tirx.decl_buffer((m, n), "float16", name="y")
    others = [p for i, p in enumerate(afunc.params) if i != site.qkv]
    n_ef, n_ei = gather.counts

    @T.prim_func(s_tir=True, check_well_formed=False)
    def emulate():
        for bx in T.serial(n // rows):
            yb = T.alloc_buffer((m * rows,), "float16")
            ef = T.alloc_buffer((max(1, n_ef),), "float32")
            ei = T.alloc_buffer((n_ei + 1,), "int64")
            for i in T.serial(m * rows):
                yb[i] = y[i // rows, gather.row_of(bx * rows + i % rows)]
            for i in T.serial(m * rows):
                n_i = T.meta_var(gather.row_of(bx * rows + i % rows))
                if gather.guard(i // rows, n_i):
                    for k in T.unroll(n_ef):
                        ef[k] = gather.early(i // rows, n_i, "float", k)
                    for k in T.unroll(n_ei):
                        ei[k] = gather.early(i // rows, n_i, "int", k)
                    made = T.meta_var(gather.store(
                        i // rows, n_i,
                        functools.partial(_block_output, yb, bx * rows, rows, gather.kernel_row),
                        functools.partial(_early_value, ef, ei, 0, n_ef, n_ei)))
                    T.buffer_store(made[0], made[2], made[1])

    return tirx.PrimFunc([y, *others], emulate.body)


def _run(func, args: list[np.ndarray]) -> list[np.ndarray]:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    arrays = [tvm.runtime.tensor(a) for a in args]
    lib["main"](*arrays)
    return [a.numpy() for a in arrays]


def _check_stores(afunc, site, gather, m, n, rows, others: list[np.ndarray]) -> None:
    """The emulated gather stores what the append PrimFunc stores, bit for bit."""
    rng = np.random.default_rng(0)
    y = rng.standard_normal((m, n)).astype("float16")
    state_pos = site.state - (site.state > site.qkv)
    ref_args = [*others[:site.qkv], y, *others[site.qkv:]]
    want = _run(afunc, ref_args)[site.state]
    got = _run(_emulation(afunc, site, gather, m, n, rows), [y, *others])[1 + state_pos]
    np.testing.assert_array_equal(got, want)


def _inputs(rng, keep) -> list[np.ndarray]:
    return [rng.standard_normal(D).astype("float16"), rng.standard_normal(D).astype("float16"),
            np.array(keep, "int32"), rng.standard_normal((M, HEADS, D)).astype("float16")]


@pytest.mark.parametrize("pairing, order", [("rotate_half", "rotate_half"), ("interleaved", "rows")])
@pytest.mark.parametrize("rows", [2, 8, 16])
def test_gather_picks_the_order_and_stores_what_the_append_does(pairing, order, rows):
    """rotate-half pairs (d, d + D/2) take the alternating order unless a block holds whole
    heads, interleaved pairs (2i, 2i + 1) W's own; either way every store (and the skipped ones:
    keep = 0) matches the append's."""
    afunc = _append(pairing)
    gather = gather_for(afunc, _SITE, M, N, rows, "float16")
    assert isinstance(gather, RowGather), gather
    one = _value(gather.row_of(_J), [(_J, np.int64(1))])
    assert (one == 1) == (order == "rows" or rows % D == 0), one
    _check_stores(afunc, _SITE, gather, M, N, rows, _inputs(np.random.default_rng(1), [1, 0]))



@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_orders_are_permutations(pairing):
    """row_of is a bijection of [0, N) and kernel_row its inverse (numpy and TIR agree)."""
    gather = gather_for(_append(pairing), _SITE, M, N, 8, "float16")
    j = np.arange(N)
    rows = _value(gather.row_of(_J), [(_J, j)])
    assert sorted(rows.tolist()) == list(range(N))
    n = tirx.Var("n", "int32")
    np.testing.assert_array_equal(_value(gather.kernel_row(n), [(n, rows)]), j)


def test_pairs_across_blocks_are_refused():
    """Three rows a block split the rotate-half and the interleaved pairs alike: no order keeps
    every read in its block, and the reason says so (the two kernels stay)."""
    for pairing in ("rotate_half", "interleaved"):
        why = gather_for(_append(pairing), _SITE, M, N, 3, "float16")
        assert isinstance(why, str) and "another block" in why, why


def test_a_data_dependent_read_is_refused():
    """A read of the GEMV's output at an index computed from data cannot be proved in-block."""
    why = gather_for(_append("data"), _SITE, M, N, 8, "float16")
    assert isinstance(why, str) and "depends on data" in why, why


def test_step_inputs_are_the_named_parameters_no_call_writes():
    """The append's loads may go before the wait only from what the step's builder names as its
    inputs (positions, offsets, ...) and their reshapes: not a named parameter a call writes in
    place (a cache), nor parameters it does not name (the decode attention's counters)."""
    from tvm import relax

    @T.prim_func
    def bump(c: T.Buffer((4,), "float16")):
        for i in range(4):
            c[i] = c[i] + T.float16(1)

    bb = relax.BlockBuilder()
    pos = relax.Var("pos", relax.TensorType([1, 1], "int64"))
    offsets = relax.Var("offsets", relax.TensorType([1], "int32"))
    cache = relax.Var("cache", relax.TensorType([4], "float16"))
    sync = relax.Var("sync", relax.TensorType([4], "int32"))
    with bb.function("step", [pos, offsets, cache, sync]):
        with bb.dataflow():
            view = bb.emit(relax.op.reshape(pos, [1]))
            bb.emit(relax.op.reshape(sync, [2, 2]))
            gv = bb.add_func(bump, "bump")
            out = bb.emit_output(relax.op.call_tir_inplace(gv, relax.Tuple([cache]), [0],
                                                           relax.TensorType([4], "float16")))
        bb.emit_func_output(relax.Tuple([view, out]))
    step = bb.finalize()["step"]
    assert gemv_append._step_inputs(step) == []  # no attribute: nothing is an input
    named = step.with_attr(STEP_INPUTS_ATTR, ["pos", "offsets", "cache"])
    assert [str(v.name) for v in gemv_append._step_inputs(named)] == ["pos", "offsets", str(view.name)]


def test_a_dtype_mismatch_is_refused():
    why = gather_for(_append("rotate_half"), _SITE, M, N, 8, "float32")
    assert isinstance(why, str) and "float32" in why, why


def _model(family: str):
    """A transformers causal LM at random init (seed 0), fp16: 2 layers, hidden 64, 4 query heads
    of 16 (2 KV heads where the family has GQA), vocab 128."""
    import transformers

    if family == "llama":
        return tiny_llama().half()
    torch.manual_seed(0)
    small = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    gpt = {"vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}
    model = {
        "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small)),
        "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **small)),
        "phi": lambda: transformers.PhiForCausalLM(transformers.PhiConfig(partial_rotary_factor=0.5,
                                                                          **small)),
        "gptj": lambda: transformers.GPTJForCausalLM(transformers.GPTJConfig(rotary_dim=16, **gpt)),
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(bos_token_id=0,
                                                                             eos_token_id=0, **gpt)),
    }[family]()
    return model.half().eval()


def _compile(max_batch: int, on: bool = True, capture: list | None = None, family: str = "llama"):
    """compile_lm of ``family`` for sm90 with ``decode_gemv_append`` = ``on``; ``capture`` gets
    ``(append PrimFunc, site, m, n, rows, gather or reason)`` of each gather the pass tried."""
    real = gemv_rule.gather_for

    def spy(afunc, site, m, n, rows, dtype):
        made = real(afunc, site, m, n, rows, dtype)
        capture.append((afunc, site, m, n, rows, made))
        return made

    gemv_rule.gather_for = spy if capture is not None else real
    try:
        with use_options(dataclasses.replace(current_options(), decode_gemv_append=on)):
            return tvmfuse.compile_lm(_model(family), target="sm90", max_seq_len=64,
                                      max_batch=max_batch, prefill_lengths=[16])
    finally:
        gemv_rule.gather_for = real


def _kernels(lib) -> list[str]:
    return re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(",
                      cuda_source(lib.executable))


def _check_captured(captured: list, max_batch: int) -> None:
    """The gather the pass used stores what the model's own append PrimFunc stores (llvm
    emulation), with sequence 0 inside the cache and sequence 1 (if any) one past it."""
    afunc, site, m, n, rows, gather = captured[0]
    assert isinstance(gather, RowGather), gather
    assert m == max_batch and rows % 2 == 0
    rng = np.random.default_rng(2)
    others = []
    for i, p in enumerate(afunc.params):
        if i == site.qkv:
            continue
        shape = [int(s) for s in p.shape]
        if "offsets" in p.name:
            others.append(np.array([7, 64][:shape[0]], str(p.dtype)))
        elif str(p.dtype).startswith("int"):  # positions
            others.append(np.full(shape, 5, str(p.dtype)))
        else:
            others.append(rng.standard_normal(shape).astype(str(p.dtype)))
    _check_stores(afunc, site, gather, m, n, rows, others)


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("max_batch", [1, 2])
def test_sm90_decode_step_loses_the_append_kernel(tmp_path, max_batch):
    """With the option the decode step has no append kernel: the QKV GEMV (one kernel for every
    layer) writes the cache; the rest stays (the lm_head's GEMV shares the QKV's fused PrimFunc
    in this model and keeps its plain kernel). nvcc builds it: sm_90a SASS without spills. The
    gather the pass used stores what the append PrimFunc stores."""
    captured: list = []
    plain = set(_kernels(_compile(max_batch, on=False)))
    lib = _compile(max_batch, capture=captured)
    folded = set(_kernels(lib))
    appends = {n for n in plain if "decode_append" in n}
    assert len(appends) == 1 and not any("decode_append" in n for n in folded), folded
    new = folded - plain
    assert len(new) == 1 and next(iter(new)).endswith("_gemv_append_kernel"), new
    assert plain - folded == appends
    source = cuda_source(lib.executable)
    start = re.search(rf"void __launch_bounds__\(\d+\) {next(iter(new))}\([^)]*\) {{", source)
    body = source[start.end():].split("\n}\n")[0]
    assert re.search(r"cache_0_ptr\[[^\]]*\] = ", body), body[-2000:]  # the GEMV writes the state
    # the append's data loads (offsets, the RoPE tables at the position) read only the step's
    # inputs and constants: launched programmatically (batch 1) they go before the wait
    assert captured[0][-1].before_wait
    wait = body.find("griddepcontrol_wait")
    assert (wait >= 0) == (max_batch == 1)
    if wait >= 0:
        early = set(re.findall(r"(\w+_ptr)\[", body[:wait]))
        assert {"offsets_ptr", "param_0_ptr", "param_1_ptr", "lv_ptr"} <= early, early
        assert "cache_0_ptr" not in early and "x_ptr" not in early
    sass = next(iter(kernel_sass(lib.export(tmp_path / "lm.so")).values()))
    text = next(t for name, t in sass.items() if name.endswith("_gemv_append_kernel"))
    assert "STL" not in text and "STG" in text
    _check_captured(captured, max_batch)


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gpt2", "gptj", "phi", "qwen3"])
def test_sm90_families_as_transformers_writes_them(family):
    """Qwen2 (QKV bias), GPT-2 (no RoPE: the append copies), GPT-J (interleaved rotary), Phi
    (rotary over half of each head: pairs within groups of 8 rows) take the GEMV append, and its
    stores match their append PrimFuncs. Qwen3 normalises q and k per head between the projection
    and the append: no append reads the GEMV's output, and its append kernel stays."""
    captured: list = []
    names = _kernels(_compile(2, capture=captured, family=family))
    if family == "qwen3":
        assert not captured and any("decode_append" in n for n in names), names
        return
    assert not any("decode_append" in n for n in names), names
    assert any(n.endswith("_gemv_append_kernel") for n in names), names
    _check_captured(captured, 2)
