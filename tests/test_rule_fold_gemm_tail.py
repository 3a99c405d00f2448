"""rules/fold_gemm_tail.py + kernels/gemm/tail.py: the QKV GEMM makes the RoPE / Q, K, V pack's
stores in its sm_90a epilogue (``Options.sm90_gemm_tail``).

CPU: the merge (the pack kernel gone, the merged kernel analysed as per-range stores with RoPE's
partner column), what is left alone, and the exported SASS (wgmma, 16-byte stores, no spills).
GPU: the LM's logits against float64 torch with the option on.
"""

from __future__ import annotations

import pytest
import torch
from tvm import relax, tirx

import tvmfuse
from models import llama_lm
from tests.cuda_tools import check_vs_float64, kernel_sass, needs_nvcc
from tvmfuse.frontend import import_model
from tvmfuse.kernels.gemm.epilogue import analyze
from tvmfuse.options import Options, use_options
from tvmfuse.pipeline import lower
from tvmfuse.targets import get_target

SMALL = dict(vocab=256, hidden=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn=512, batch=1, seq=128)


def _stages(options: Options, target: str = "sm90", **size) -> dict:
    module, inputs = llama_lm.build(**{**SMALL, **size})
    stages: dict = {}
    lower(import_model(module, inputs).mod, get_target(target), "float16",
          on_stage=lambda n, m: stages.__setitem__(n, m), options=options)
    return stages


def _prims(mod) -> dict:
    """The PrimFuncs ``main`` calls, by name."""
    called = {b.value.args[0].name_hint for block in mod["main"].body.blocks for b in block.bindings
              if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.call_tir"}
    return {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc) and gv.name_hint in called}


def test_qkv_gemm_takes_the_pack():
    """Option on: each layer's pack kernel is gone; the merged GEMM reads as three column ranges
    (q, k, v of the packed buffer, each row-major) with RoPE's partner at col ^ D/2."""
    stages = _stages(Options(sm90_gemm_tail=True))
    before, after = _prims(stages["fuse_tir"]), _prims(stages["fold_gemm_tail"])
    assert sum("concatenate" in n for n in before) == 1  # the pack (one PrimFunc, two calls)
    assert not any("concatenate" in n for n in after), sorted(after)
    (name,) = [n for n in after if n.endswith("_gather_tail")]
    g = analyze(after[name])
    s, h, kv, d = 128, 4, 2, 64
    assert (g.m, g.n, g.tail.half, g.tail.size) == (s, (h + 2 * kv) * d, d // 2, s * (h + 2 * kv) * d)
    assert [(x.j0, x.width, x.base, x.stride) for x in g.tail.segments] == [
        (0, h * d, 0, h * d), (h * d, kv * d, s * h * d, kv * d),
        (h * d + kv * d, kv * d, s * (h + kv) * d, kv * d)]
    q, k, v = (str(x.expr) for x in g.tail.segments)
    assert "partner" in q and "partner" in k and v == "own"  # V is copied, q and k rotate
    kernels = _prims(stages["schedule"])
    assert sum(n.startswith(name) for n in kernels) == 2  # in-loop statistics, producer partials
    assert all(kernels[n].attrs["tvmfuse.rule"].startswith("gemm_sm90")
               for n in kernels if n.startswith(name))


def test_left_alone_when_off_or_not_sm90a():
    for options, target in [(Options(), "sm90"), (Options(sm90_gemm_tail=True), "sm80")]:
        stages = _stages(options, target)
        assert any("concatenate" in n for n in _prims(stages["fold_gemm_tail"]
                                                       if "fold_gemm_tail" in stages
                                                       else stages["schedule"]))


def test_decode_sized_gemms_are_left_to_the_gemv():
    """M below the GEMV's limit: no merge (the GEMV has its own append fold)."""
    stages = _stages(Options(sm90_gemm_tail=True), seq=32)
    assert not any(n.endswith("_gather_tail") for n in _prims(stages["fold_gemm_tail"]))


@needs_nvcc
def test_kernel_compiles_without_spills(tmp_path):
    module, inputs = llama_lm.build(**{**SMALL, "seq": 200})  # ragged M: guarded row tiles
    with use_options(Options(sm90_gemm_tail=True)):
        path = tvmfuse.compile(module, inputs, target="sm90").export(tmp_path / "lm.so")
    kernels = kernel_sass(path)["sm_90a"]
    tails = [s for n, s in kernels.items() if "_gather_tail" in n]
    assert len(tails) == 2, sorted(kernels)
    assert all("HGMMA" in s and "STG.E.128" in s and "STL" not in s for s in tails)
    assert not any("concatenate" in n for n in kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [128, 200, 1024])
def test_gpu_llama_lm(seq, tmp_path):
    """Logits with the pack in the QKV GEMM against float64 torch (ragged M at 200; 1024 rows:
    cluster pairs, 256 or 128-column tiles)."""
    module, inputs = llama_lm.build(vocab=2048, hidden=1024, n_layers=2, n_heads=8, n_kv_heads=2,
                                    ffn=2816, seq=seq, dtype=torch.float16)
    with use_options(Options(sm90_gemm_tail=True)):
        check_vs_float64(module, inputs, "sm90", tmp_path, 5e-3)
