"""Attention kernels behind ``attention_primfunc``: CPU numerics, CUDA builds and SASS, GPU numerics.

CPU: ``attention_cpu_primfunc`` against a float64 numpy reference over causal kinds, bias shapes,
GQA/MQA, ragged lengths and head dims. CUDA (no GPU needed): the flash and decode PrimFuncs build
with nvcc for sm80 and sm90a, their SASS holds the tensor-core instructions (HMMA, LDSM, LDGSTS)
and ptxas reports no spills. ``gpu``: rel err against a float64 torch reference on the device.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import tvm

from tests.cuda_tools import needs_nvcc
from tvmfuse.kernels.attention.cpu import attention_cpu_primfunc
from tvmfuse.kernels.attention.spec import AttentionSpec
from tvmfuse.rules.attention import attention_primfunc


def reference(q, k, v, bias, spec: AttentionSpec) -> np.ndarray:
    """float64 attention in BSNH; rows that see no key are 0 (the kernels' convention)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    k = np.repeat(k, spec.group, axis=2)
    v = np.repeat(v, spec.group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * spec.scale
    if spec.softcap is not None:  # logit soft-capping, before bias and mask
        s = spec.softcap * np.tanh(s / spec.softcap)
    if bias is not None:
        s = s + np.asarray(bias, dtype=np.float64)
    if spec.causal != "none":
        off = 0 if spec.causal == "TopLeft" else spec.kv_len - spec.q_len
        i = np.arange(spec.q_len)[:, None]
        j = np.arange(spec.kv_len)[None]
        s = np.where(j <= i + off, s, -np.inf)
        if spec.window is not None:  # sliding window: the last ``window`` keys up to the diagonal
            s = np.where(j > i + off - spec.window, s, -np.inf)
    m = s.max(-1, keepdims=True)
    seen = np.isfinite(m)
    p = np.where(seen, np.exp(s - np.where(seen, m, 0)), 0.0)
    den = p.sum(-1, keepdims=True)
    p = p / np.where(den > 0, den, 1)
    return np.einsum("bhij,bjhd->bihd", p, v)


def random_inputs(spec: AttentionSpec, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((spec.batch, spec.q_len, spec.q_heads, spec.head_dim))
    k = rng.standard_normal((spec.batch, spec.kv_len, spec.kv_heads, spec.head_dim))
    v = rng.standard_normal((spec.batch, spec.kv_len, spec.kv_heads, spec.value_dim))
    bias = None
    if spec.bias_shape is not None:
        bias = rng.standard_normal(spec.bias_shape)
        if spec.bias_shape[0] == spec.batch and spec.bias_shape[1:3] == (1, 1):
            # a padding mask: the last keys of batch 0 are masked out
            bias[0, ..., -(spec.kv_len // 3):] = -1e9
    return q, k, v, bias


def _spec(b, sq, skv, hq, hkv, d, dtype="float32", causal="none", bias=None, bias_dtype=None,
          layouts=("BSHD", "BSHD"), softcap=None, dv=None):
    """``softcap``: the random inputs' scores (unit-normal q, k at scale 1/√d) are about unit
    normal, so a cap of 1–2 bends most of them. ``dv``: the value head dim where it differs (MLA)."""
    return AttentionSpec(b, sq, skv, hq, hkv, d, dtype, 1.0 / np.sqrt(d), causal, bias,
                         bias_dtype or (dtype if bias else None), qkv_layout=layouts[0],
                         out_layout=layouts[1], softcap=softcap, v_head_dim=dv)


def in_layout(x, layout: str):
    """A (B, S, H, D) array (numpy or torch) laid out in ``layout`` (contiguous); its inverse too
    (each layout is one swap of two axes)."""
    if layout == "BSHD":
        return x
    a, b = (1, 2) if layout == "BHSD" else (0, 1)
    t = x.transpose(a, b) if hasattr(x, "contiguous") else np.swapaxes(x, a, b)
    return t.contiguous() if hasattr(t, "contiguous") else np.ascontiguousarray(t)


# (qkv_layout, out_layout) pairs other than the default, each exercised below
LAYOUTS = {"bhsd": ("BHSD", "BHSD"), "bhsd_in": ("BHSD", "BSHD"), "bhsd_out": ("BSHD", "BHSD"),
           "sbhd_out": ("BSHD", "SBHD"), "bhsd_in_sbhd_out": ("BHSD", "SBHD")}


CPU_CASES = {
    "mha": _spec(2, 17, 17, 4, 4, 64),
    "causal_topleft": _spec(1, 40, 40, 2, 2, 64, causal="TopLeft"),
    "causal_bottomright_kvcache": _spec(1, 9, 70, 4, 2, 64, causal="BottomRight"),
    "causal_topleft_sq_gt_skv": _spec(1, 50, 33, 2, 2, 64, causal="TopLeft"),
    "causal_bottomright_sq_gt_skv": _spec(1, 50, 33, 2, 2, 64, causal="BottomRight"),
    "gqa_d128": _spec(2, 33, 65, 8, 2, 128),
    "mqa": _spec(1, 20, 45, 4, 1, 64, causal="TopLeft"),
    "padding_mask": _spec(2, 31, 31, 4, 4, 64, bias=(2, 1, 1, 31)),
    "full_bias_causal": _spec(2, 24, 24, 4, 2, 64, causal="TopLeft", bias=(2, 4, 24, 24)),
    "head_bias": _spec(1, 12, 40, 4, 4, 64, bias=(1, 4, 1, 40)),
    "decode": _spec(3, 1, 100, 8, 2, 128),
    "fp16": _spec(1, 35, 35, 4, 2, 128, "float16", causal="TopLeft", bias=(1, 1, 1, 35),
                  bias_dtype="float32"),
    "bf16": _spec(1, 35, 35, 4, 2, 64, "bfloat16", bias=(1, 1, 35, 35)),
    # logit soft-capping (Gemma-2): c · tanh(s / c) before the bias and the mask
    "softcap_causal_gqa": _spec(1, 40, 40, 4, 2, 64, causal="TopLeft", softcap=1.5),
    "softcap_bias_fp16": _spec(2, 31, 31, 4, 4, 64, "float16", bias=(2, 1, 1, 31), softcap=2.0),
    "softcap_decode": _spec(3, 1, 100, 8, 2, 128, softcap=1.0),
    # multi-head latent attention (DeepSeek-V2/V3): q·k over 192 dims, values of 128
    "mla_causal": _spec(1, 40, 40, 4, 4, 192, causal="TopLeft", dv=128),
    "mla_gqa_bias_fp16": _spec(2, 31, 45, 4, 2, 24, "float16", bias=(2, 1, 1, 45), dv=16),
}


def _run_cpu(spec: AttentionSpec, q, k, v, bias) -> np.ndarray:
    lib = tvm.compile(tvm.IRModule({"main": attention_cpu_primfunc(spec)}), target="llvm")

    def dev(x, dtype):
        if dtype == "bfloat16":  # numpy has no bfloat16: round through float32 bits
            bits = np.asarray(x, np.float32).view(np.uint32)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            t = tvm.runtime.empty(x.shape, "bfloat16")
            t.copyfrom(bits)
            return t, (bits.astype(np.uint32) << 16).view(np.float32)
        a = np.asarray(x).astype(dtype)
        return tvm.runtime.tensor(a), a

    args, rounded = [], []
    for x, dt in ((q, spec.dtype), (k, spec.dtype), (v, spec.dtype)):
        t, r = dev(in_layout(x, spec.qkv_layout), dt)
        args.append(t)
        rounded.append(in_layout(r, spec.qkv_layout))  # BHSD → BSHD is the same swap
    if bias is not None:
        t, r = dev(bias, spec.bias_dtype)
        args.append(t)
        rounded.append(r)
    else:
        rounded.append(None)
    out = tvm.runtime.empty(spec.out_shape, spec.result_dtype)
    lib["main"](*args, out)
    o = in_layout(out.numpy(), spec.out_layout)
    if spec.result_dtype == "bfloat16":
        o = (o.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return o.astype(np.float64), reference(*rounded, spec)


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_numerics(name):
    spec = CPU_CASES[name]
    out, ref = _run_cpu(spec, *random_inputs(spec))
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[spec.dtype]
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < tol, f"{name}: rel err {err:.2e} ≥ {tol}"
    if spec.causal == "BottomRight" and spec.q_len > spec.kv_len:
        assert not out[:, : spec.q_len - spec.kv_len].any(), "rows seeing no key must be 0"


@pytest.mark.parametrize("layouts", list(LAYOUTS))
@pytest.mark.parametrize("name", ["causal_topleft", "causal_bottomright_kvcache", "gqa_d128",
                                  "mqa", "padding_mask", "decode", "fp16"])
def test_cpu_numerics_in_layout(name, layouts):
    """q/k/v and out in (B, H, S, D): the kernel reads and writes them through the layout."""
    spec = dataclasses.replace(CPU_CASES[name], qkv_layout=LAYOUTS[layouts][0],
                               out_layout=LAYOUTS[layouts][1])
    out, ref = _run_cpu(spec, *random_inputs(spec))
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[spec.dtype]
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < tol, f"{name} {layouts}: rel err {err:.2e} ≥ {tol}"


def test_cpu_all_masked_bias_row_is_zero():
    spec = _spec(1, 4, 8, 1, 1, 64, bias=(1, 1, 4, 8))
    q, k, v, bias = random_inputs(spec)
    bias[0, 0, 2] = -np.inf
    out, _ = _run_cpu(spec, q, k, v, bias)
    assert np.isfinite(out).all() and not out[0, 2].any()
    assert out[0, 1].any()


def test_cpu_no_score_matrix_buffer():
    """Every allocation in the lowered CPU kernel is smaller than one Sq×Skv score matrix."""
    spec = _spec(1, 64, 96, 2, 2, 64, causal="TopLeft")
    text = attention_cpu_primfunc(spec).script()
    shapes = re.findall(r"alloc_buffer\(\(([\d, ]+)\)", text)
    sizes = [int(np.prod([int(x) for x in sh.split(",") if x.strip()])) for sh in shapes]
    assert sizes, "expected row-local scratch allocations"
    assert max(sizes) < spec.q_len * spec.kv_len


def test_dispatch_cpu_target():
    spec = CPU_CASES["mha"]
    f = attention_primfunc(spec, tvm.target.Target("llvm"))
    assert len(f.params) == 4


def test_bad_bias_shape_is_named():
    spec = _spec(2, 8, 8, 2, 2, 64, bias=(3, 1, 1, 8))
    with pytest.raises(ValueError, match="does not broadcast"):
        attention_cpu_primfunc(spec)


# --------------------------------------------------------------------------------------------
# CUDA kernels: build with nvcc (no GPU needed), inspect SASS and the ptxas report


def _cuda_fatbin(func, target_name: str, tmp_path) -> tuple[bytes, str]:
    """(fatbin, ptxas -v report) of ``func`` built for a tvmfuse CUDA target."""
    import os

    from tvmfuse.build.nvcc import compile_fatbin
    from tvmfuse.targets import get_target

    spec = get_target(target_name)
    previous = os.environ.get("TVM_COMPILE_FORCE_FALLBACK")
    os.environ["TVM_COMPILE_FORCE_FALLBACK"] = "1"  # keep CUDA source, nvcc builds it below
    try:
        lib = tvm.compile(tvm.IRModule({"main": func}), target=spec.tvm_target())
    finally:
        if previous is None:
            del os.environ["TVM_COMPILE_FORCE_FALLBACK"]
        else:
            os.environ["TVM_COMPILE_FORCE_FALLBACK"] = previous
    source = lib.mod.imports[0].inspect_source()
    fatbin = compile_fatbin(source, spec, tmp_path)
    return fatbin, (tmp_path / "kernels.ptxas.log").read_text()


def _sass(fatbin: bytes) -> dict[str, str]:
    """``{arch: SASS}``; a cuobjdump failure fails the test (``needs_nvcc`` skips a missing tool)."""
    from tvmfuse.build.inspect import fatbin_sass

    return fatbin_sass(fatbin)


def _assert_no_spills(report: str) -> None:
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, report
    assert all(s == ("0", "0") for s in spills), f"register spills:\n{report}"


FLASH_BUILDS = {
    "causal_d128_fp16_sm80": (_spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft"), "sm80"),
    "bias_d64_bf16_sm90": (_spec(2, 100, 177, 4, 4, 64, "bfloat16", bias=(2, 1, 1, 177)), "sm90"),
    "causal_gqa_d32_fp16_sm80": (_spec(2, 300, 300, 8, 2, 32, "float16", causal="TopLeft"), "sm80"),
    "bhsd_causal_gqa_d128_fp16_sm80": (_spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft",
                                             layouts=LAYOUTS["bhsd"]), "sm80"),
    "sbhd_out_causal_gqa_d32_fp16_sm80": (_spec(3, 300, 300, 8, 2, 32, "float16", causal="TopLeft",
                                                layouts=LAYOUTS["sbhd_out"]), "sm80"),
    "softcap_causal_gqa_d128_fp16_sm80": (_spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft",
                                                softcap=50.0), "sm80"),
    "mla_causal_d192_v128_fp16_sm80": (_spec(2, 300, 300, 8, 8, 192, "float16", causal="TopLeft",
                                             dv=128), "sm80"),
    "mla_causal_d192_v128_bf16_sm90": (_spec(1, 300, 300, 8, 8, 192, "bfloat16", causal="TopLeft",
                                             dv=128), "sm90"),
}


@needs_nvcc
@pytest.mark.parametrize("name", list(FLASH_BUILDS))
def test_flash_attention_builds_with_tensor_cores(name, tmp_path):
    from tvmfuse.kernels.attention.flash_sm80 import flash_attention_primfunc

    spec, target = FLASH_BUILDS[name]
    func = attention_primfunc(spec, tvm.target.Target({"kind": "cuda", "arch": "sm_80"}))
    assert func.attrs["tir.is_scheduled"]
    assert [p.name for p in func.params] == [p.name for p in flash_attention_primfunc(spec).params]
    fatbin, report = _cuda_fatbin(func, target, tmp_path)
    _assert_no_spills(report)
    sass = _sass(fatbin)
    archs = [a for a in sass if a.startswith("sm_")]
    assert archs == (["sm_80", "sm_90"] if target == "sm80" else ["sm_90a"])
    for arch in archs:
        for instr in ("HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS"):
            assert instr in sass[arch], f"{name}: no {instr} in {arch} SASS"
        assert "MUFU.EX2" in sass[arch]
        assert ("MUFU.TANH" in sass[arch]) == (spec.softcap is not None), name


@needs_nvcc
@pytest.mark.parametrize("layouts", ["bshd", "bhsd", "bshd_softcap"])
def test_flash_decode_builds(layouts, tmp_path):
    softcap = 50.0 if layouts.endswith("softcap") else None
    spec = _spec(4, 1, 1000, 32, 8, 128, "float16", causal="BottomRight",
                 layouts=LAYOUTS.get(layouts, ("BSHD", "BSHD")), softcap=softcap)
    func = attention_primfunc(spec, tvm.target.Target({"kind": "cuda", "arch": "sm_80"}))
    assert str(func.attrs["global_symbol"]) == "flash_decode"
    fatbin, report = _cuda_fatbin(func, "sm80", tmp_path)
    _assert_no_spills(report)
    assert report.count("Compiling entry function") >= 2 or "flash_decode_kernel_1" in report
    sass = _sass(fatbin)
    assert "SHFL.BFLY" in sass["sm_80"] and "LDG.E.128" in sass["sm_80"]
    assert ("MUFU.TANH" in sass["sm_80"]) == (softcap is not None)


def test_flash_rejects_unsupported():
    from tvmfuse.kernels.attention.flash_sm80 import FlashConfig, flash_attention_primfunc

    with pytest.raises(ValueError, match="head_dim 96"):
        flash_attention_primfunc(_spec(1, 64, 64, 2, 2, 96, "float16"))
    with pytest.raises(ValueError, match="dtype float32"):
        flash_attention_primfunc(_spec(1, 64, 64, 2, 2, 64, "float32"))
    with pytest.raises(ValueError, match="does not divide"):
        flash_attention_primfunc(_spec(1, 64, 64, 2, 2, 64, "float16"), config=FlashConfig(block_n=24))


def test_mla_dispatch():
    """A value head dim of its own (MLA, 192 / 128): the sm80 flash kernel on sm80 and, with the
    reason, on sm_90a (the wgmma kernel has one head dim); at Sq = 1 the row fallback."""
    spec = _spec(1, 64, 64, 4, 4, 192, "float16", "TopLeft", dv=128)
    sm80 = attention_primfunc(spec, tvm.target.Target({"kind": "cuda", "arch": "sm_80"}))
    assert str(sm80.attrs["global_symbol"]) == "flash_attention" and "tvmfuse.fallback" not in sm80.attrs
    sm90 = attention_primfunc(spec, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    assert str(sm90.attrs["global_symbol"]) == "flash_attention"
    assert "value head dim 128 differs" in str(sm90.attrs["tvmfuse.fallback"])
    assert re.findall(r"T.Buffer\(\(([\d, ]+)\)", sm90.script())[:4] == [
        "1, 64, 4, 192", "1, 64, 4, 192", "1, 64, 4, 128", "1, 64, 4, 128"]
    from tvmfuse.kernels.attention.flash_sm80 import flash_attention_primfunc

    with pytest.raises(ValueError, match="head dims 128 .q, k. and 64"):
        flash_attention_primfunc(_spec(1, 64, 64, 2, 2, 128, "float16", dv=64))
    decode = dataclasses.replace(spec, q_len=1, causal="BottomRight")
    func = attention_primfunc(decode, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    assert "value head dim 128 differs" in str(func.attrs["tvmfuse.fallback"])
    assert spec.flops == 2 * 4 * (192 + 128) * (64 * 65 // 2)


@needs_nvcc
def test_generic_cuda_fallback_for_what_flash_does_not_take(tmp_path):
    """fp32 / head dim 16: still one CUDA kernel (no Sq×Skv buffer), marked as a fallback."""
    spec = _spec(2, 40, 40, 4, 2, 16, "float32", causal="TopLeft")
    for arch in ("sm_80", "sm_90a"):
        func = attention_primfunc(spec, tvm.target.Target({"kind": "cuda", "arch": arch}))
        assert "head_dim 16" in str(func.attrs["tvmfuse.fallback"]) or "float32" in str(
            func.attrs["tvmfuse.fallback"])
    text = func.script()
    shapes = re.findall(r"alloc_buffer\(\(([\d, ]+)\)", text)
    assert max(int(np.prod([int(x) for x in sh.split(",") if x.strip()])) for sh in shapes) < 40 * 40
    fatbin, _ = _cuda_fatbin(func, "sm90", tmp_path)
    assert "MUFU.EX2" in _sass(fatbin)["sm_90a"]


# --------------------------------------------------------------------------------------------
# GPU: rel err against float64 torch on random inputs, every variant

GPU_CASES = {
    "mha_d128_fp16": _spec(2, 256, 256, 4, 4, 128, "float16"),
    "causal_d128_ragged_fp16": _spec(2, 200, 200, 4, 4, 128, "float16", causal="TopLeft"),
    "causal_d64_gqa_bf16": _spec(1, 300, 300, 4, 2, 64, "bfloat16", causal="TopLeft"),
    "gqa_ragged_d64_fp16": _spec(2, 77, 333, 8, 2, 64, "float16"),
    "mqa_bottomright_d128_bf16": _spec(1, 100, 260, 8, 1, 128, "bfloat16", causal="BottomRight"),
    "padding_bias_d128_fp16": _spec(2, 130, 130, 4, 4, 128, "float16", bias=(2, 1, 1, 130)),
    "full_bias_causal_d64_bf16": _spec(1, 96, 96, 2, 2, 64, "bfloat16", "TopLeft", (1, 2, 96, 96)),
    "sq_gt_skv_bottomright_fp16": _spec(1, 150, 70, 2, 2, 64, "float16", causal="BottomRight"),
    "decode_gqa_d128_fp16": _spec(3, 1, 1000, 32, 8, 128, "float16"),
    "decode_mha_d64_bf16_bias": _spec(2, 1, 777, 4, 4, 64, "bfloat16", bias=(2, 1, 1, 777)),
    "decode_mqa_d128_fp16_causal": _spec(2, 1, 300, 16, 1, 128, "float16", causal="BottomRight"),
    # head dim 32: 64-byte rows, swizzled by row pairs
    "bottomright_d32_fp16": _spec(1, 50, 90, 2, 2, 32, "float16", causal="BottomRight"),
    "causal_d32_gqa_ragged_fp16": _spec(2, 300, 300, 8, 2, 32, "float16", causal="TopLeft"),
    "padding_bias_d32_bf16": _spec(2, 130, 130, 4, 4, 32, "bfloat16", bias=(2, 1, 1, 130)),
    # specs the flash kernels do not take: the one-thread-per-row CUDA-core fallback
    "generic_fp32_d16_causal_gqa_bias": _spec(2, 70, 70, 4, 2, 16, "float32", "TopLeft", (2, 1, 1, 70)),
    "generic_fp16_d48_bottomright": _spec(1, 50, 90, 2, 2, 48, "float16", causal="BottomRight"),
    # q/k/v and out in (B, H, S, D) (FoldAttentionLayout), every kernel
    "bhsd_causal_gqa_d128_fp16": _spec(2, 200, 200, 8, 2, 128, "float16", "TopLeft",
                                       layouts=LAYOUTS["bhsd"]),
    "bhsd_in_full_gqa_d64_bf16": _spec(2, 77, 333, 8, 2, 64, "bfloat16", layouts=LAYOUTS["bhsd_in"]),
    "bhsd_out_causal_d64_fp16": _spec(1, 150, 150, 4, 4, 64, "float16", "TopLeft",
                                      layouts=LAYOUTS["bhsd_out"]),
    # out sequence first (torch's nn.MultiheadAttention, batch_first=False), every kernel
    "sbhd_out_full_gqa_d128_fp16": _spec(2, 150, 150, 8, 2, 128, "float16",
                                         layouts=LAYOUTS["sbhd_out"]),
    "sbhd_out_causal_d32_fp16": _spec(3, 70, 70, 4, 2, 32, "float16", "TopLeft",
                                      layouts=LAYOUTS["bhsd_in_sbhd_out"]),
    "decode_sbhd_out_gqa_d128_fp16": _spec(3, 1, 1000, 32, 8, 128, "float16",
                                           layouts=LAYOUTS["sbhd_out"]),
    "generic_sbhd_out_fp16_d48": _spec(2, 70, 70, 4, 2, 48, "float16", "TopLeft",
                                       layouts=LAYOUTS["sbhd_out"]),
    "bhsd_bias_d128_fp16": _spec(2, 130, 130, 4, 4, 128, "float16", bias=(2, 1, 1, 130),
                                 layouts=LAYOUTS["bhsd"]),
    "decode_bhsd_gqa_d128_fp16": _spec(3, 1, 1000, 32, 8, 128, "float16", layouts=LAYOUTS["bhsd"]),
    "bhsd_causal_gqa_d32_fp16": _spec(2, 70, 70, 4, 2, 32, "float16", "TopLeft",
                                      layouts=LAYOUTS["bhsd"]),
    "generic_bhsd_fp16_d48_causal_gqa": _spec(2, 70, 70, 4, 2, 48, "float16", "TopLeft",
                                              layouts=LAYOUTS["bhsd"]),
    # logit soft-capping (tanh.approx.f32 in the flash and split-KV kernels, tanhf in the row
    # fallback)
    "softcap_causal_gqa_d128_fp16": _spec(2, 200, 200, 8, 2, 128, "float16", "TopLeft", softcap=1.5),
    "softcap_bias_d64_bf16": _spec(2, 130, 130, 4, 4, 64, "bfloat16", bias=(2, 1, 1, 130),
                                   softcap=2.0),
    "decode_softcap_gqa_d128_fp16": _spec(3, 1, 1000, 32, 8, 128, "float16", softcap=1.0),
    "generic_softcap_fp16_d48_causal": _spec(1, 50, 50, 2, 2, 48, "float16", "TopLeft", softcap=1.0),
    # multi-head latent attention: q·k over 192 dims, values of 128 (the sm80 flash kernel on
    # every arch; decode has no split-KV kernel for it, the row fallback takes it)
    "mla_causal_d192_v128_fp16": _spec(2, 200, 200, 8, 8, 192, "float16", "TopLeft", dv=128),
    "mla_ragged_bias_d192_v128_bf16": _spec(2, 77, 333, 4, 4, 192, "bfloat16", bias=(2, 1, 1, 333),
                                            dv=128),
    "generic_mla_decode_d192_v128_fp16": _spec(2, 1, 300, 8, 8, 192, "float16", "BottomRight",
                                               dv=128),
}
# the kernel each case must run (``global_symbol`` of the dispatched PrimFunc) and whether its
# CUDA source issues tensor-core mma.sync: decode_* the split-KV kernel, generic_* the fallback
GPU_KERNELS = {name: ("flash_decode", False) if name.startswith("decode_") else
               ("attention", False) if name.startswith("generic_") else ("flash_attention", True)
               for name in GPU_CASES}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_numerics(name):
    import torch

    from tvmfuse.build.inspect import cuda_source

    spec = GPU_CASES[name]
    major, minor = torch.cuda.get_device_capability()
    target = tvm.target.Target({"kind": "cuda", "arch": f"sm_{major}{minor}"}, host={"kind": "llvm"})
    func = attention_primfunc(spec, target)
    symbol, mma = GPU_KERNELS[name]
    assert str(func.attrs["global_symbol"]) == symbol, func.attrs
    assert ("tvmfuse.fallback" in func.attrs) == (symbol == "attention"), func.attrs
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    assert ("mma.sync" in cuda_source(lib)) == mma
    q, k, v, bias = random_inputs(spec)
    dt = getattr(torch, spec.dtype)
    tq, tk, tv = (torch.from_numpy(x).to("cuda", dt) for x in (q, k, v))  # (B, S, H, D)
    args = [in_layout(x, spec.qkv_layout) for x in (tq, tk, tv)]
    if bias is not None:
        args.append(torch.from_numpy(bias).to("cuda", getattr(torch, spec.bias_dtype)))
    out = torch.full(spec.out_shape, float("nan"), dtype=dt, device="cuda")
    lib["main"](*[tvm.runtime.from_dlpack(x) for x in (*args, out)])
    ref = reference(*[x.cpu().double().numpy() for x in (tq, tk, tv)],
                    None if bias is None else args[3].cpu().double().numpy(), spec)
    got = in_layout(out, spec.out_layout).cpu().double().numpy()
    assert np.isfinite(got).all(), f"{name}: NaN / inf in the output"
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    tol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5}[spec.dtype]
    assert err < tol, f"{name}: rel err {err:.2e} ≥ {tol}"
