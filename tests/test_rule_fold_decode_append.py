"""FoldDecodeAppend (rules/fold_decode_append.py): compile_lm's decode append folded into the
split-KV attention kernel, one launch a layer fewer. GPU numerics: test_llm_compile_lm's
``test_sm90_generate_on_the_gpu`` (greedy tokens against torch, the fold on by default)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import tvm
from tvm import tirx

from tests.cuda_tools import kernel_sass, needs_nvcc
from tvmfuse.options import current_options, use_options
from tvmfuse.rules.fold_decode_append import _substitute, _Unknown

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import tvmfuse  # noqa: E402
from tvmfuse.build.inspect import cuda_source  # noqa: E402


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().half()


def _kernels(lib) -> list[str]:
    return re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(",
                      cuda_source(lib.executable))


def _compile(fold: bool):
    opts = dataclasses.replace(current_options(), decode_fold_append=fold)
    with use_options(opts):
        return tvmfuse.compile_lm(_llama(), target="sm90", max_seq_len=64, max_batch=2,
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


def test_substitute_replaces_the_block_vars():
    """The value expression of the append's store, rebuilt with (b, h, d) for its block vars."""
    vh, vd = tirx.Var("vh", "int64"), tirx.Var("vd", "int64")
    buf = tirx.decl_buffer((4, 8), "float16", name="x")
    expr = tirx.if_then_else(vh < 2, tirx.BufferLoad(buf, [vh, vd]) * tirx.const(2, "float16"),
                             tirx.BufferLoad(buf, [vh, tirx.floormod(vd + 4, 8)]))
    h = tirx.Var("h", "int32")
    got = _substitute(expr, [(vh, tirx.Cast("int64", h)), (vd, tirx.IntImm("int64", 3))])
    def i64(n):
        return tirx.IntImm("int64", n)

    h64, three = tirx.Cast("int64", h), i64(3)
    expected = tirx.if_then_else(h64 < 2, tirx.BufferLoad(buf, [h64, three]) * tirx.const(2, "float16"),
                                 tirx.BufferLoad(buf, [h64, tirx.FloorMod(tirx.Add(three, i64(4)), i64(8))]))
    tvm.ir.assert_structural_equal(got, expected)  # rebuilt node for node (no constant folding)
    tvm.ir.assert_structural_equal(_substitute(expr, []), expr)  # nothing to replace


def test_substitute_declines_unknown_kinds():
    """An expression kind it does not rebuild makes the fold decline (both kernels stay)."""
    v = tirx.Var("v", "int32")
    with pytest.raises(_Unknown):
        _substitute(tvm.tirx.Let(v, 1, v + 1), [])
