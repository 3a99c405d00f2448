"""PrefetchDecodeWeights (rules/prefetch_decode_weights.py): compile_lm's sm90 decode attention
prefetches the next GEMVs' weights into L2 before its PDL wait. GPU numerics: test_llm_compile_lm's
``test_sm90_generate_on_the_gpu[weight_prefetch]`` (greedy tokens against torch)."""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import tvm

from tests.cuda_tools import kernel_sass, needs_nvcc
from tests.lm_reference import tiny_llama
from tvmfuse.options import current_options, use_options
from tvmfuse.targets import get_target

pytest.importorskip("transformers")

import tvmfuse  # noqa: E402
from tvmfuse.attrs import PREFETCH_ONLY_ATTR  # noqa: E402
from tvmfuse.build.inspect import cuda_source  # noqa: E402
from tvmfuse.report import primfunc_bytes  # noqa: E402
from tvmfuse.rules.prefetch_decode_weights import PrefetchDecodeWeights  # noqa: E402


class _Captured(Exception):
    """Stops compile_lm's lowering once the module the stage receives is captured."""


def _pass_input(monkeypatch, max_batch: int = 1) -> tvm.IRModule:
    """compile_lm's sm90 module as the prefetch_decode_weights stage receives it (after ``gemv``);
    batch 1: the decode kernels launch with PDL (Options.programmatic_launch_max_batch)."""
    compile_lm = importlib.import_module("tvmfuse.llm.compile_lm")
    real, seen = compile_lm.lower, {}

    def lower(*args, **kwargs):
        def on_stage(name, mod):
            if name == "gemv":
                seen["mod"] = mod
                raise _Captured

        return real(*args, on_stage=on_stage, **kwargs)

    monkeypatch.setattr(compile_lm, "lower", lower)
    with pytest.raises(_Captured):
        tvmfuse.compile_lm(tiny_llama().half(), target="sm90", max_seq_len=64, max_batch=max_batch,
                           prefill_lengths=[16])
    return seen["mod"]


def _calls(func) -> list:
    """(callee name, call) of every call_tir in ``func``'s bindings, in order."""
    return [(b.value.args[0].name_hint, b.value) for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, tvm.relax.Call) and getattr(b.value.op, "name", "") == "relax.call_tir"]


def _run(mod: tvm.IRModule, budget: int) -> tvm.IRModule:
    with get_target("sm90").tvm_target():
        with use_options(dataclasses.replace(current_options(), decode_weight_prefetch_bytes=budget)):
            return PrefetchDecodeWeights()(mod)


def _weight(call) -> tvm.ir.expr.Constant:
    """The largest 2-D constant a GEMV call reads (its weight)."""
    consts = [a for a in call.args[1].fields
              if isinstance(a, tvm.ir.expr.Constant) and len(a.value.shape) == 2]
    return max(consts, key=lambda c: c.value.shape[0] * c.value.shape[1])


def test_each_attention_takes_the_weights_of_the_gemvs_after_it(monkeypatch):
    """Budget = the O projection's weight and one more row: each layer's attention call takes the
    weight constants of the two GEMVs after it (the very constants they read, in call order), one
    rebuilt kernel serves both layers, its extra parameters are marked prefetch-only (the report
    counts their bytes for the GEMVs), the old attention PrimFunc goes, the input module stays as
    it was; budget 0 returns the module untouched."""
    mod = _pass_input(monkeypatch)
    text = mod.script()
    assert _run(mod, 0).same_as(mod)
    before = _calls(mod["decode"])
    attn_at = [i for i, (n, _) in enumerate(before) if n == "decode_cache_attention0"]
    assert len(attn_at) == 2, [n for n, _ in before]
    gemvs = [[c for n, c in before[i + 1:j] if n.endswith("_gemv")] for i, j in
             zip(attn_at, [*attn_at[1:], len(before)])]
    o_weight = _weight(gemvs[0][0])
    rows, k = (int(x) for x in o_weight.value.shape)
    budget = rows * k * 2 + k * 2  # the O weight and one row of the next
    after = _run(mod, budget)
    assert mod.script() == text  # the caller's module is not modified
    calls = _calls(after["decode"])
    new = [(i, c) for i, (n, c) in enumerate(calls) if n.startswith("decode_cache_attention0_prefetch")]
    assert len(new) == 2 and len({calls[i][0] for i, _ in new}) == 1, [n for n, _ in calls]
    for (_, call), layer_gemvs in zip(new, gemvs):
        extra = list(call.args[1].fields)[4:]
        assert len(extra) == 2
        assert extra[0].same_as(_weight(layer_gemvs[0])) and extra[1].same_as(_weight(layer_gemvs[1]))
    assert "decode_cache_attention0" not in {gv.name_hint for gv in after.functions}
    kernel = after[new[0][1].args[0]]
    assert [int(i) for i in kernel.attrs[PREFETCH_ONLY_ATTR]] == [4, 5]
    assert primfunc_bytes(kernel) == primfunc_bytes(mod["decode_cache_attention0"])
    # the kernel: the second weight gets one row a block at most (budget), prefetched before the wait
    script = kernel.script()
    assert script.index("w1") < script.index('griddepcontrol("wait"') < script.index("qr[")


def test_no_prefetch_without_programmatic_launch(monkeypatch):
    """Batch 2 (above Options.programmatic_launch_max_batch) launches without PDL: the kernel
    would have no predecessor to overlap, so nothing changes."""
    mod = _pass_input(monkeypatch, max_batch=2)
    assert _run(mod, 1 << 30).same_as(mod)


@needs_nvcc
@pytest.mark.slow
def test_sm90_library_builds_and_keeps_one_copy_of_each_weight(tmp_path):
    """The whole library with the option: the attention's partial kernel issues the weights' bulk
    L2 prefetches (one thread, before griddepcontrol.wait), nvcc builds it without spills
    (UBLKPF in the SASS), and the weights file holds each weight once."""
    model = tiny_llama().half()
    opts = dataclasses.replace(current_options(), decode_weight_prefetch_bytes=1 << 20)
    with use_options(opts):
        lib = tvmfuse.compile_lm(model, target="sm90", max_seq_len=64, max_batch=1, prefill_lengths=[16])
    src = cuda_source(lib.executable)
    start = re.search(r"decode_cache_attention0_prefetch_kernel\([^;{]*\) \{", src).start()
    body = src[start:src.index("\n}\n", start)]
    pf = body[body.index("threadIdx.x) == 32)"):body.index("griddepcontrol_wait")]
    assert len(re.findall(r"prefetch_L2_global\(\(&\(w\d_ptr", pf)) >= 4, pf
    path = lib.export(tmp_path / "lm.so")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert path.with_suffix(".safetensors").stat().st_size <= params + 2 * 64 * 16 * 2 + 16384
    sass = next(iter(kernel_sass(path).values()))
    partial = next(text for name, text in sass.items() if name.endswith("attention0_prefetch_kernel"))
    assert "UBLKPF" in partial and "STL" not in partial, partial[:2000]
