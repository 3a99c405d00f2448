"""Sliding-window attention kernels (``AttentionSpec.window``): the band, its tiles, its numerics.

Key j is visible to query i iff ``i + off − w < j ≤ i + off`` (``off`` the causal offset; the
meaning of ``R.nn.attention``'s ``window_size``, kernels/attention/spec.py). Checked here:
* :func:`band_tiles` against the mask entry by entry: the KV tiles a query tile visits are exactly
  those holding a visible key, and the unmasked ones hold only visible keys;
* every generator starts its KV loop at the band (the loop bound depends on the query tile / row)
  and the trip count of the bench shape (S 8192, w 1024) is the band's, not the causal one's;
* the cpu kernel (llvm) and ``R.nn.attention(window_size=w)`` through tvmfuse's legalisation
  against torch (SDPA with the band as a bool mask, float64) for several (S, w), w not a multiple
  of the tile and w ≥ S;
* the sm80 and sm90a kernels with a window build with nvcc (tensor-core SASS, no spills);
* ``gpu``: every CUDA kernel (sm90a, sm80 forced, split-KV decode, the CUDA-core fallback) with a
  window against torch on the device.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from tests.cuda_tools import needs_nvcc
from tests.test_attention_kernels import LAYOUTS, _run_cpu, _spec, in_layout, random_inputs
from tvmfuse.kernels.attention.spec import AttentionSpec, band_tiles, causal_offset
from tvmfuse.rules.attention import attention_primfunc


def _wspec(b, sq, skv, hq, hkv, d, dtype="float32", causal="BottomRight", window=None,
           layouts=("BSHD", "BSHD")) -> AttentionSpec:
    return dataclasses.replace(_spec(b, sq, skv, hq, hkv, d, dtype, causal, layouts=layouts),
                               window=window)


def _visible(spec: AttentionSpec) -> np.ndarray:
    """(Sq, Skv) bool: the band, entry by entry."""
    off = causal_offset(spec)
    i, j = np.arange(spec.q_len)[:, None], np.arange(spec.kv_len)[None]
    vis = j <= i + off
    return vis & (j > i + off - spec.window) if spec.window is not None else vis


def torch_reference(q, k, v, spec: AttentionSpec) -> np.ndarray:
    """float64 torch SDPA in (B, S, H, D) with the band as a bool mask; rows seeing no key are 0."""
    q, k, v = (torch.from_numpy(np.asarray(x, np.float64)).transpose(1, 2) for x in (q, k, v))
    keep = torch.from_numpy(_visible(spec))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=keep, scale=spec.scale, enable_gqa=spec.group > 1)
    out = torch.where(keep.any(-1)[:, None], out, 0.0)  # the kernels' rule for an empty row
    return out.transpose(1, 2).numpy()


# --- band_tiles: the tile range of a query tile ---------------------------------------------------


def _int(x) -> int:
    return int(x.value) if hasattr(x, "value") else int(x)


@pytest.mark.parametrize("causal", ["TopLeft", "BottomRight"])
def test_band_tiles_exact(causal: str):
    """[start, end) = the tiles with a visible key; [lo, hi) ⊆ the tiles with only visible keys."""
    for sq, skv in [(1, 40), (40, 40), (9, 70), (50, 33), (130, 130)]:
        for window in (None, 1, 5, 16, 17, 40, 200):
            spec = _wspec(1, sq, skv, 1, 1, 64, causal=causal, window=window)
            vis = _visible(spec)
            for tile, rows in [(8, 1), (16, 16), (32, 48)]:
                n_kv = (skv + tile - 1) // tile
                for m0 in range(0, sq, rows):
                    last = min(m0 + rows, sq) - 1
                    start, lo, hi, end = (_int(x) for x in band_tiles(spec, m0, last, tile))
                    block = vis[m0:last + 1]
                    hit = [t for t in range(n_kv) if block[:, t * tile:(t + 1) * tile].any()]
                    where = (sq, skv, window, tile, m0)
                    assert (start, end) == ((hit[0], hit[-1] + 1) if hit else (end, end)), where
                    assert start <= lo <= hi <= end, where
                    for t in range(lo, hi):
                        assert (t + 1) * tile <= skv and block[:, t * tile:(t + 1) * tile].all(), where


def _tiles_visited(spec: AttentionSpec, bm: int, bn: int) -> int:
    """KV tiles all query tiles of ``bm`` rows visit (Σ end − start of :func:`band_tiles`)."""
    total = 0
    for m0 in range(0, spec.q_len, bm):
        start, _, _, end = band_tiles(spec, m0, min(m0 + bm, spec.q_len) - 1, bn)
        total += _int(end) - _int(start)
    return total


def test_bench_shape_visits_the_band_only():
    """S 8192, w 1024, 128×128 tiles: ≤ 9 KV tiles per query tile instead of up to 64."""
    causal = _wspec(1, 8192, 8192, 16, 16, 128, "float16")
    band = dataclasses.replace(causal, window=1024)
    assert _tiles_visited(causal, 128, 128) == 64 * 65 // 2
    assert _tiles_visited(band, 128, 128) == 8 * 9 // 2 + (64 - 8) * 9  # diagonal tile + 8 back
    assert _tiles_visited(band, 128, 128) / _tiles_visited(causal, 128, 128) < 0.27  # 540 / 2080


# --- the generators: the KV loop starts at the band -------------------------------------------------

W_BIG = _wspec(1, 1000, 1000, 4, 4, 128, "float16", window=300)


def test_sm90_loop_starts_at_band():
    from tvmfuse.kernels.attention.flash_sm90 import flash_attention_sm90_primfunc

    text = flash_attention_sm90_primfunc(W_BIG).script()
    # the producer and the consumers run n_it = n_end − n_start tiles, n_start from m0
    assert "n_start: T.int32 = T.min(T.max(m0 - 300 + 1, 0) // 128" in text
    assert "n_it: T.int32 = n_end - n_start" in text
    assert text.count("for jj in range(n_it):") == 1 and "for jj in range(1, 1 + (n_it - 1))" in text
    # without a window there is no band edge to mask
    plain = flash_attention_sm90_primfunc(dataclasses.replace(W_BIG, window=None)).script()
    assert "m0 - 300" not in plain and "jj >= n_edge" not in plain and "jj >= n_edge" in text


def test_sm80_loop_starts_at_band():
    from tvmfuse.kernels.attention.flash_sm80 import flash_attention_primfunc

    text = flash_attention_primfunc(W_BIG).script()
    assert "n_start: T.let[T.int32] = T.min(T.max(m0 - 300 + 1, 0) // 64" in text
    # masked left edge, unmasked middle, masked diagonal: together n_end − n_start tiles
    for extent in ("n_lo - n_start", "n_full - n_lo", "n_end - n_full"):
        assert f"in range({extent}):" in text, extent


def test_cpu_loop_starts_at_band():
    from tvmfuse.kernels.attention.cpu import attention_cpu_primfunc

    text = attention_cpu_primfunc(dataclasses.replace(W_BIG, dtype="float32")).script()
    assert "t0: T.let[T.int32] = T.min(T.max(i - 300 + 1, 0) // 32" in text


def test_window_needs_causal():
    with pytest.raises(ValueError, match="needs a causal kind"):
        _wspec(1, 8, 8, 1, 1, 16, causal="none", window=3)
    with pytest.raises(ValueError, match="window >= 1"):
        _wspec(1, 8, 8, 1, 1, 16, window=0)


# --- cpu numerics against torch -----------------------------------------------------------------

CPU_CASES = {
    # (S, w): w below / not a multiple of / a multiple of the 32-key tile, w ≥ S
    "s70_w5": _wspec(1, 70, 70, 2, 2, 64, window=5),
    "s70_w33": _wspec(1, 70, 70, 2, 2, 64, window=33),
    "s96_w64_gqa": _wspec(2, 96, 96, 4, 2, 64, window=64),
    "s40_w40": _wspec(1, 40, 40, 2, 2, 64, window=40),
    "s40_w100": _wspec(1, 40, 40, 2, 2, 64, "float16", window=100),
    "s1_w1": _wspec(1, 1, 1, 2, 2, 64, window=1),
    "kvcache_bottomright": _wspec(1, 9, 70, 4, 2, 64, window=20),
    "topleft_sq_gt_skv": _wspec(1, 50, 33, 2, 2, 64, causal="TopLeft", window=7),  # empty rows
    "decode_row": _wspec(2, 1, 100, 4, 1, 128, window=37),
    "bhsd_fp16": _wspec(1, 65, 65, 4, 2, 128, "float16", window=17, layouts=LAYOUTS["bhsd"]),
}


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_numerics_vs_torch(name: str):
    spec = CPU_CASES[name]
    q, k, v, _ = random_inputs(spec)
    got, _ = _run_cpu(spec, q, k, v, None)
    rounded = [np.asarray(x).astype(spec.dtype) for x in (q, k, v)]
    ref = torch_reference(*rounded, spec)
    tol = 1e-5 if spec.dtype == "float32" else 2e-3
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("sq, skv, window, causal", [(48, 48, 13, "BottomRight"),
                                                     (16, 80, 40, "BottomRight"),
                                                     (40, 40, 64, "TopLeft")])
def test_relax_window_size_lowered_vs_torch(sq: int, skv: int, window: int, causal: str):
    """``R.nn.attention(window_size=w)`` through tvmfuse's legalisation (the cpu kernel)."""
    from tvmfuse.passes.legalize_fixes import legalize_overrides

    spec = _wspec(2, sq, skv, 4, 2, 32, causal=causal, window=window)
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType(spec.q_shape, "float32"))
    k, v = (relax.Var(n, relax.TensorType(spec.kv_shape, "float32")) for n in "kv")
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            o = bb.emit_output(relax.op.nn.attention(q, k, v, causal_mask=causal,
                                                     window_size=window))
        bb.emit_func_output(o)
    mod = relax.transform.LegalizeOps(legalize_overrides())(bb.get())
    kernels = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 1  # one kernel, no Sq×Skv score tensor
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    arrays = random_inputs(spec)[:3]
    got = vm["main"](*[tvm.runtime.tensor(a.astype("float32")) for a in arrays]).numpy()
    np.testing.assert_allclose(got, torch_reference(*arrays, spec), rtol=1e-5, atol=1e-5)


def test_window_without_causal_is_an_error():
    """TVM gives ``window_size`` no meaning without a causal mask: a CompileError naming the call."""
    from tvmfuse.errors import CompileError
    from tvmfuse.pipeline import lower
    from tvmfuse.targets import get_target

    t = relax.TensorType((1, 8, 2, 16), "float32")
    q = relax.Var("q", t)
    bb = relax.BlockBuilder()
    with bb.function("main", [q]):
        with bb.dataflow():
            o = bb.emit_output(relax.op.nn.attention(q, q, q, window_size=3))
        bb.emit_func_output(o)
    with pytest.raises(CompileError, match="window_size 3 needs causal_mask"):
        lower(bb.get(), get_target("cpu"), None)


@pytest.mark.parametrize("gate_on", [True, False], ids=["default", "gpu_window_attention_off"])
def test_cuda_window_kernels_gated(gate_on: bool):
    """``R.nn.attention(window_size=w)`` lowered for sm90: the window kernel by default; with
    ``Options(gpu_window_attention=False)`` the call is decomposed (no attention kernel, the band
    as a constant mask)."""
    import json

    from tvmfuse.options import Options, use_options
    from tvmfuse.passes.legalize_fixes import legalize_overrides
    from tvmfuse.targets import get_target

    q = relax.Var("q", relax.TensorType((1, 256, 4, 64), "float16"))
    k, v = (relax.Var(n, relax.TensorType((1, 256, 2, 64), "float16")) for n in "kv")
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            o = bb.emit_output(relax.op.nn.attention(q, k, v, causal_mask="BottomRight",
                                                     window_size=100))
        bb.emit_func_output(o)
    with get_target("sm90").tvm_target(), use_options(Options(gpu_window_attention=gate_on)):
        mod = relax.transform.LegalizeOps(legalize_overrides())(bb.get())
    specs = [json.loads(str(f.attrs["tvmfuse.attention_spec"])) for f in mod.functions.values()
             if isinstance(f, tvm.tirx.PrimFunc) and "tvmfuse.attention_spec" in f.attrs]
    if gate_on:
        assert [s.get("window") for s in specs] == [100], specs
    else:  # the decomposition: softmax over the (B, H, Sq, Skv) scores
        assert specs == []
        assert any("softmax" in gv.name_hint for gv in mod.functions), list(mod.functions)


# --- CUDA builds (nvcc, no GPU) -------------------------------------------------------------------

CUDA_BUILDS = {
    "sm80": (_wspec(2, 300, 300, 8, 2, 128, "float16", window=100), "sm_80", "sm80"),
    "sm90a": (_wspec(2, 300, 300, 8, 2, 128, "float16", window=100), "sm_90a", "sm90"),
    "sm90a_bf16_d64_bhsd": (_wspec(1, 333, 333, 4, 4, 64, "bfloat16", window=77,
                                   layouts=LAYOUTS["bhsd"]), "sm_90a", "sm90"),
    "decode_sm80": (_wspec(4, 1, 1000, 32, 8, 128, "float16", window=300), "sm_80", "sm80"),
}


@needs_nvcc
@pytest.mark.parametrize("name", list(CUDA_BUILDS))
def test_window_kernels_build_with_nvcc(name: str, tmp_path, monkeypatch):
    from tests.test_attention_kernels import _assert_no_spills, _cuda_fatbin, _sass
    from tests.test_attention_sm90 import _build_sass

    spec, arch, target = CUDA_BUILDS[name]
    func = attention_primfunc(spec, tvm.target.Target({"kind": "cuda", "arch": arch}))
    assert "tvmfuse.fallback" not in func.attrs, func.attrs["tvmfuse.fallback"]
    if target == "sm90":
        sass, report = _build_sass(func.with_attr("global_symbol", "main"), tmp_path, monkeypatch)
        assert "HGMMA" in sass and "UTMALDG" in sass
    else:
        fatbin, report = _cuda_fatbin(func, target, tmp_path)
        sass = _sass(fatbin)["sm_80"]
        if spec.q_len == 1:  # the split-KV decode kernel: CUDA cores, 16-byte loads
            assert "SHFL.BFLY" in sass and "LDG.E.128" in sass
        else:
            assert "HMMA.16816.F32" in sass and "LDGSTS" in sass
    _assert_no_spills(report)


# --- GPU numerics ---------------------------------------------------------------------------------

GPU_CASES = {
    "s8192_w1024_d128_fp16": _wspec(1, 8192, 8192, 2, 2, 128, "float16", window=1024),
    "s1000_w300_gqa_d128_fp16": _wspec(2, 1000, 1000, 8, 2, 128, "float16", window=300),
    "s777_w100_d64_bf16": _wspec(1, 777, 777, 4, 4, 64, "bfloat16", window=100),
    "s300_w1000_d64_fp16": _wspec(1, 300, 300, 2, 2, 64, "float16", window=1000),
    "kvcache_bottomright_d128_fp16": _wspec(1, 100, 1200, 4, 4, 128, "float16", window=333),
    "topleft_sq_gt_skv_d64_fp16": _wspec(1, 300, 150, 2, 2, 64, "float16", "TopLeft", 70),
    "bhsd_w129_d128_fp16": _wspec(1, 700, 700, 4, 2, 128, "float16", window=129,
                                  layouts=LAYOUTS["bhsd"]),
    "decode_w500_d128_fp16": _wspec(3, 1, 3000, 32, 8, 128, "float16", window=500),
    "generic_fp32_d32": _wspec(1, 200, 200, 2, 2, 32, "float32", window=45),
}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["dispatched", "sm80", "persistent"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_numerics_vs_torch(name: str, kernel: str):
    """The dispatched kernel (sm90a on an H200), the sm80 flash kernel forced on the device, and
    the sm90a kernel with persistent CTAs (``Options.sm90_attention_persistent``)."""
    from tvmfuse.kernels.attention.flash_sm80 import check, flash_attention_primfunc
    from tvmfuse.kernels.attention.flash_sm90 import NAME
    from tvmfuse.options import Options, use_options

    spec = GPU_CASES[name]
    major, minor = torch.cuda.get_device_capability()
    arch = "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"
    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host={"kind": "llvm"})
    if kernel == "sm80":
        if spec.q_len == 1 or check(spec) is not None:
            pytest.skip("the sm80 flash kernel does not take this spec")
        func = flash_attention_primfunc(spec, target).with_attr("global_symbol", "main")
    elif kernel == "persistent":
        with use_options(Options(sm90_attention_persistent=True)):
            func = attention_primfunc(spec, target).with_attr("global_symbol", "main")
        if str(func.attrs.get("tvmfuse.rule", "")) != NAME:
            pytest.skip("not the sm90a kernel on this GPU / spec")
    else:
        func = attention_primfunc(spec, target).with_attr("global_symbol", "main")
        if arch == "sm_90a" and spec.q_len > 1 and spec.dtype != "float32" and spec.head_dim != 32:
            assert str(func.attrs["tvmfuse.rule"]) == NAME, func.attrs
    pipeline = "tirx" if "tvmfuse.tirx" in func.attrs else None
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target,
                      **({"tir_pipeline": pipeline} if pipeline else {}))
    q, k, v, _ = random_inputs(spec)
    dt = getattr(torch, spec.dtype)
    bshd = [torch.from_numpy(x).to("cuda", dt) for x in (q, k, v)]
    args = [in_layout(x, spec.qkv_layout) for x in bshd]
    out = torch.full(spec.out_shape, float("nan"), dtype=dt, device="cuda")
    lib["main"](*[tvm.runtime.from_dlpack(x) for x in (*args, out)])
    ref = torch_reference(*[x.cpu().double().numpy() for x in bshd], spec)
    got = in_layout(out, spec.out_layout).cpu().double().numpy()
    assert np.isfinite(got).all(), f"{name}: NaN / inf in the output"
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    tol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5}[spec.dtype]
    assert err < tol, f"{name} ({kernel}): rel err {err:.2e} ≥ {tol}"
