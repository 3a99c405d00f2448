"""sm_90a flash attention (TMA + wgmma, warp-specialised): builds, SASS, dispatch, pipeline, GPU numerics.

CPU (no GPU needed): the kernel builds with the tirx pipeline and nvcc for sm_90a; its SASS holds
HGMMA (both products), UTMALDG (TMA loads) and MUFU.EX2, and ptxas reports no spills;
``attention_primfunc`` picks it on sm_90a and falls back (with the reason) where it does not
apply; a model's attention goes through ``tvmfuse.compile`` and the export into the fatbin.
``gpu``: rel err against a float64 reference (causal / non-causal, fp16 / bf16, D 64 / 128,
ragged lengths, GQA / MQA, BottomRight with Sq > Skv, additive biases: padding masks and T5-style
(1, H, Sq, Skv) ones, rows a bias masks wholly).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import tvm

from tests.cuda_tools import needs_nvcc
from tests.test_attention_kernels import LAYOUTS, _spec, in_layout, random_inputs, reference
from tvmfuse.kernels.attention.flash_sm90 import (
    NAME,
    Sm90FlashConfig,
    check,
    flash_attention_sm90_primfunc,
)
from tvmfuse.rules.attention import attention_primfunc
from tvmfuse.targets import get_target

SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host={"kind": "llvm"})


def _build_sass(func, tmp_path, monkeypatch) -> tuple[str, str]:
    """(sm_90a SASS, ptxas -v report) of a standalone kernel built with nvcc."""
    from tvmfuse.build.inspect import fatbin_sass
    from tvmfuse.build.nvcc import compile_fatbin

    monkeypatch.setenv("TVM_COMPILE_FORCE_FALLBACK", "1")  # keep CUDA source, nvcc builds it
    lib = tvm.compile(tvm.IRModule({"main": func}), target=get_target("sm90").tvm_target(),
                      tir_pipeline="tirx")
    source = lib.mod.imports[0].inspect_source()
    fatbin = compile_fatbin(source, get_target("sm90"), tmp_path)
    sass = fatbin_sass(fatbin)["sm_90a"]  # a cuobjdump failure fails the test
    return sass, (tmp_path / "kernels.ptxas.log").read_text()


BUILDS = {
    "causal_d128_fp16_gqa_ragged": (_spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft"),
                                    None, (128, 128)),
    "full_d64_bf16": (_spec(1, 200, 333, 4, 4, 64, "bfloat16"), None, (128, 64)),
    "bn64_3stage_d128": (_spec(1, 256, 256, 2, 1, 128, "float16", causal="BottomRight"),
                         Sm90FlashConfig(block_n=64, stages=3), (64, 128)),
    "serial_direct_store": (_spec(1, 200, 200, 2, 2, 128, "bfloat16"),
                            Sm90FlashConfig(overlap=False, pingpong=False, tma_store=False),
                            (128, 128)),
    "bhsd_causal_gqa_d128": (_spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft",
                                   layouts=LAYOUTS["bhsd"]), None, (128, 128)),
    "bhsd_in_direct_store_d64": (_spec(1, 200, 333, 4, 2, 64, "bfloat16", layouts=LAYOUTS["bhsd_in"]),
                                 Sm90FlashConfig(tma_store=False), (128, 64)),
    "persistent_bhsd_causal_d128": (_spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft",
                                          layouts=LAYOUTS["bhsd"]), Sm90FlashConfig(persistent_ctas=5),
                                    (128, 128)),
    "sbhd_out_causal_d128": (_spec(3, 200, 200, 8, 2, 128, "float16", causal="TopLeft",
                                   layouts=LAYOUTS["sbhd_out"]), Sm90FlashConfig(persistent_ctas=5),
                             (128, 128)),
    "persistent_serial_direct_store": (_spec(1, 200, 200, 2, 2, 128, "bfloat16"),
                                       Sm90FlashConfig(overlap=False, pingpong=False, tma_store=False,
                                                       persistent_ctas=3), (128, 128)),
    # additive biases: a padding mask (B, 1, 1, Skv) on ragged causal GQA, T5's (1, H, Sq, Skv)
    "bias_padding_causal_gqa_d128_fp16": (
        _spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft", bias=(2, 1, 1, 300)), None,
        (128, 128)),
    "bias_heads_rows_d64_bf16_persistent": (
        _spec(1, 200, 333, 4, 4, 64, "bfloat16", bias=(1, 4, 200, 333)),
        Sm90FlashConfig(persistent_ctas=5), (128, 64)),
    # logit soft-capping: one MUFU.TANH per score beside the MUFU.EX2
    "softcap_causal_gqa_d128_fp16": (
        _spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft", softcap=50.0), None, (128, 128)),
}


@needs_nvcc
@pytest.mark.parametrize("name", list(BUILDS))
def test_builds_to_hgmma_and_tma_without_spills(name, tmp_path, monkeypatch):
    spec, cfg, (n_s, n_o) = BUILDS[name]
    sass, report = _build_sass(flash_attention_sm90_primfunc(spec, config=cfg, name="main"),
                               tmp_path, monkeypatch)
    dt = {"float16": "", "bfloat16": ".BF16"}[spec.dtype]  # SASS spells only bf16 inputs
    hgmma = set(re.findall(r"HGMMA\.64x\d+x16\.F32[.A-Z0-9]*", sass))
    assert f"HGMMA.64x{n_s}x16.F32{dt}" in hgmma, f"no S = Q·Kᵀ wgmma in {hgmma}"
    assert f"HGMMA.64x{n_o}x16.F32{dt}" in hgmma, f"no O += P·V wgmma in {hgmma}"
    assert "UTMALDG.4D" in sass, "no TMA tile loads"
    tma_store = (cfg or Sm90FlashConfig()).tma_store
    assert ("UTMASTG.4D" in sass) == tma_store, "O is stored by TMA exactly when configured"
    assert "MUFU.EX2" in sass
    assert ("MUFU.TANH" in sass) == (spec.softcap is not None)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), report


@needs_nvcc
def test_bias_loads(tmp_path, monkeypatch):
    """Without a bias every operand comes by TMA (no LDG); a padding mask (B, 1, 1, Skv) is read
    once per key column a thread holds (its two rows share the load), a (1, H, Sq, Skv) bias once
    per score: half the loads (ragged Skv, the guarded copy: at most half)."""
    def loads(spec) -> int:
        sass, _ = _build_sass(flash_attention_sm90_primfunc(spec, name="main"), tmp_path, monkeypatch)
        return len(re.findall(r"\bLDG", sass))

    assert loads(_spec(1, 256, 256, 4, 4, 64, "float16")) == 0
    rows = loads(_spec(2, 256, 256, 4, 4, 64, "float16", bias=(1, 4, 256, 256)))
    assert rows > 0
    assert 2 * loads(_spec(2, 256, 256, 4, 4, 64, "float16", bias=(2, 1, 1, 256))) == rows
    assert 0 < 2 * loads(_spec(2, 300, 300, 4, 4, 64, "float16", bias=(2, 1, 1, 300))) <= rows


def test_dispatch_sm90a_picks_wgmma_kernel():
    spec = _spec(1, 128, 128, 2, 2, 128, "float16", causal="TopLeft")
    func = attention_primfunc(spec, SM90A)
    assert func.attrs["tvmfuse.rule"] == NAME and func.attrs["tvmfuse.tirx"]
    assert [str(p.dtype) for p in func.params] and len(func.params) == 4
    sm80 = attention_primfunc(spec, tvm.target.Target({"kind": "cuda", "arch": "sm_80"}))
    assert "tvmfuse.rule" not in sm80.attrs, "the sm80 target keeps the mma.sync kernel"


def test_dispatch_falls_back_with_reason():
    spec = _spec(2, 64, 64, 2, 2, 96, "float16")
    func = attention_primfunc(spec, SM90A)
    assert "tvmfuse.tirx" not in func.attrs and len(func.params) == 4
    assert "head_dim 96" in str(func.attrs["tvmfuse.fallback"])


def test_dispatch_takes_a_bias():
    """An additive bias (a padding mask as BERT passes it) is the kernel's fifth parameter, in
    the order ``q, k, v, bias, out`` every attention kernel takes, with
    ``Options.sm90_attention_bias`` on (the default since its GPU tests passed, session 33); off,
    the sm80-style kernel takes it and the reason is recorded."""
    from tvmfuse.options import Options, use_options

    spec = _spec(2, 64, 64, 2, 2, 64, "float16", bias=(2, 1, 1, 64))
    func = attention_primfunc(spec, SM90A)
    assert func.attrs["tvmfuse.rule"] == NAME and len(func.params) == 5
    assert [p.name for p in func.params] == ["q", "k", "v", "bias", "out"]
    with use_options(Options(sm90_attention_bias=False)):
        func = attention_primfunc(spec, SM90A)
    assert "sm90_attention_bias off" in str(func.attrs["tvmfuse.fallback"])
    assert "tvmfuse.tirx" not in func.attrs and len(func.params) == 5


def test_unsupported_reasons():
    assert "head_dim 96" in check(_spec(1, 64, 64, 2, 2, 96, "float16"))
    assert "dtype float32" in check(_spec(1, 64, 64, 2, 2, 64, "float32"))
    assert "shared memory" in check(_spec(1, 64, 64, 2, 2, 128, "float16"),
                                          Sm90FlashConfig(block_n=256, stages=3))
    with pytest.raises(ValueError, match="head_dim 80"):
        flash_attention_sm90_primfunc(_spec(1, 64, 64, 2, 2, 80, "float16"))


@needs_nvcc
def test_pipeline_and_export_hold_the_wgmma_attention(tmp_path):
    """Decoder layer (GQA, D 128) at fp16 for sm90: one attention kernel, HGMMA + TMA in the fatbin."""
    import tvmfuse
    from models import decoder_layer
    from tvmfuse.build.inspect import cuda_images, fatbin_sass

    module, example = decoder_layer.build(seq=192, hidden=256, n_heads=2, n_kv_heads=1)
    lib = tvmfuse.compile(module, example, target="sm90", dtype="float16")
    (fmt, code), = cuda_images(lib.export(tmp_path / "m.so"))
    assert fmt == "fatbin"
    sass = fatbin_sass(code)["sm_90a"]
    names = re.findall(r"Function : (\S+)", sass)
    attn = [n for n in names if "attention" in n]
    assert len(attn) == 1, names
    body = sass.split(f"Function : {attn[0]}")[1].split("Function : ")[0]
    assert "HGMMA.64x128x16.F32 " in body and "UTMALDG.4D" in body


# --------------------------------------------------------------------------------------------
# GPU: rel err against float64 on random inputs

GPU_CASES = {
    "causal_d128_fp16": (_spec(1, 1024, 1024, 2, 2, 128, "float16", causal="TopLeft"), None),
    "full_d128_bf16": (_spec(2, 256, 256, 4, 4, 128, "bfloat16"), None),
    "causal_ragged_gqa_d128_fp16": (_spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft"),
                                    None),
    "causal_ragged_d64_bf16": (_spec(1, 200, 200, 4, 2, 64, "bfloat16", causal="TopLeft"), None),
    "full_ragged_gqa_d64_fp16": (_spec(2, 77, 333, 8, 2, 64, "float16"), None),
    "mqa_bottomright_d128_bf16": (_spec(1, 100, 260, 8, 1, 128, "bfloat16", "BottomRight"),
                                  None),
    "sq_gt_skv_bottomright_d64_fp16": (_spec(1, 150, 70, 2, 2, 64, "float16", "BottomRight"),
                                       None),
    "bn64_causal_d128_fp16": (_spec(1, 333, 333, 2, 2, 128, "float16", causal="TopLeft"),
                              Sm90FlashConfig(block_n=64)),
    "serial_direct_store_causal_gqa_fp16": (
        _spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft"),
        Sm90FlashConfig(overlap=False, pingpong=False, tma_store=False)),
    # q/k/v and out in (B, H, S, D): TMA maps over (D, S, H, B)
    "bhsd_causal_ragged_gqa_d128_fp16": (
        _spec(2, 300, 300, 8, 2, 128, "float16", "TopLeft", layouts=LAYOUTS["bhsd"]), None),
    "bhsd_in_full_ragged_gqa_d64_bf16": (
        _spec(2, 77, 333, 8, 2, 64, "bfloat16", layouts=LAYOUTS["bhsd_in"]), None),
    "bhsd_out_bottomright_d128_fp16": (
        _spec(1, 100, 260, 8, 1, 128, "float16", "BottomRight", layouts=LAYOUTS["bhsd_out"]), None),
    "bhsd_direct_store_causal_d128_bf16": (
        _spec(1, 333, 333, 4, 2, 128, "bfloat16", "TopLeft", layouts=LAYOUTS["bhsd"]),
        Sm90FlashConfig(tma_store=False)),
    # out sequence first (the TMA store's map over (D, H, B, S)), and with the direct store
    "sbhd_out_causal_ragged_gqa_d128_fp16": (
        _spec(3, 300, 300, 8, 2, 128, "float16", "TopLeft", layouts=LAYOUTS["sbhd_out"]),
        Sm90FlashConfig(persistent_ctas=7)),
    "bhsd_in_sbhd_out_full_d64_bf16": (
        _spec(2, 77, 333, 8, 2, 64, "bfloat16", layouts=LAYOUTS["bhsd_in_sbhd_out"]),
        Sm90FlashConfig(tma_store=False)),
    # persistent CTAs: fewer CTAs than query tiles (several rounds each, both directions), the
    # barrier phases, Q and the O staging tile carried from tile to tile
    "persistent_causal_ragged_gqa_d128_fp16": (
        _spec(2, 300, 300, 8, 2, 128, "float16", "TopLeft"), Sm90FlashConfig(persistent_ctas=7)),
    "persistent_bhsd_causal_d128_fp16": (
        _spec(4, 1024, 1024, 4, 4, 128, "float16", "TopLeft", layouts=LAYOUTS["bhsd"]),
        Sm90FlashConfig(persistent_ctas=13)),
    "persistent_full_ragged_gqa_d64_bf16": (
        _spec(2, 77, 333, 8, 2, 64, "bfloat16"), Sm90FlashConfig(persistent_ctas=5)),
    "persistent_sq_gt_skv_bottomright_d64_fp16": (
        _spec(1, 150, 70, 2, 2, 64, "float16", "BottomRight"), Sm90FlashConfig(persistent_ctas=3)),
    "persistent_more_ctas_than_tiles_mqa_bf16": (
        _spec(1, 100, 260, 8, 1, 128, "bfloat16", "BottomRight"), Sm90FlashConfig(persistent_ctas=132)),
    "persistent_serial_direct_store_fp16": (
        _spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft"),
        Sm90FlashConfig(overlap=False, pingpong=False, tma_store=False, persistent_ctas=6)),
    "persistent_bn64_3stage_bf16": (
        _spec(1, 333, 333, 2, 2, 128, "bfloat16", causal="TopLeft"),
        Sm90FlashConfig(block_n=64, stages=3, persistent_ctas=2)),
    # additive biases (random_inputs masks the last third of batch 0's keys in a padding mask)
    "bias_padding_full_d64_fp16": (_spec(2, 512, 512, 12, 12, 64, "float16", bias=(2, 1, 1, 512)),
                                   None),
    "bias_padding_causal_ragged_gqa_d128_bf16": (
        _spec(2, 300, 300, 8, 2, 128, "bfloat16", "TopLeft", bias=(2, 1, 1, 300)), None),
    "bias_t5_heads_rows_ragged_d64_fp16": (
        _spec(1, 77, 333, 4, 4, 64, "float16", bias=(1, 4, 77, 333)), None),
    "bias_rows_bhsd_persistent_d128_fp16": (
        _spec(2, 200, 200, 4, 2, 128, "float16", "TopLeft", bias=(2, 1, 200, 200),
              layouts=LAYOUTS["bhsd"]), Sm90FlashConfig(persistent_ctas=5)),
    "bias_padding_serial_direct_store_bf16": (
        _spec(2, 200, 200, 2, 2, 128, "bfloat16", bias=(2, 1, 1, 200)),
        Sm90FlashConfig(overlap=False, pingpong=False, tma_store=False)),
    # logit soft-capping (cap 1.5: most unit-normal scores bent), with a bias and serial
    "softcap_causal_ragged_gqa_d128_fp16": (
        _spec(2, 300, 300, 8, 2, 128, "float16", "TopLeft", softcap=1.5), None),
    "softcap_bias_padding_serial_d64_bf16": (
        _spec(2, 200, 200, 2, 2, 64, "bfloat16", bias=(2, 1, 1, 200), softcap=2.0),
        Sm90FlashConfig(overlap=False, pingpong=False, tma_store=False)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_numerics(name):
    import torch

    from tvmfuse.build.inspect import cuda_source

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a kernels need a Hopper (9.0) GPU")
    spec, cfg = GPU_CASES[name]
    func = flash_attention_sm90_primfunc(spec, SM90A, cfg, name="main")
    assert func.attrs["tvmfuse.rule"] == NAME
    lib = tvm.compile(tvm.IRModule({"main": func}), target=SM90A, tir_pipeline="tirx")
    source = cuda_source(lib)  # the one kernel the call launches: TMA loads, wgmma products
    assert "wgmma.mma_async" in source and "cp.async.bulk.tensor" in source
    q, k, v, bias = random_inputs(spec)
    if spec.bias_shape is not None and spec.bias_shape[2] > 1:
        bias[0, 0, 5, :] = -1e9  # a query row that sees no key: its output is 0
    dt = getattr(torch, spec.dtype)
    bshd = [torch.from_numpy(x).to("cuda", dt) for x in (q, k, v)]
    args = [in_layout(x, spec.qkv_layout) for x in bshd]
    if bias is not None:  # the reference reads the bias as the kernel does: rounded to its dtype
        args.append(torch.from_numpy(bias).to("cuda", getattr(torch, spec.bias_dtype)))
    out = torch.full(spec.out_shape, float("nan"), dtype=dt, device="cuda")
    lib["main"](*[tvm.runtime.from_dlpack(x) for x in (*args, out)])
    ref = reference(*[x.cpu().double().numpy() for x in bshd],
                    None if bias is None else args[-1].cpu().double().numpy(), spec)
    got = in_layout(out, spec.out_layout).cpu().double().numpy()
    assert np.isfinite(got).all(), f"{name}: NaN / inf in the output"
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    tol = {"float16": 2e-3, "bfloat16": 1e-2}[spec.dtype]
    assert err < tol, f"{name}: rel err {err:.2e} ≥ {tol}"


def test_persistent_option_gives_one_cta_per_sm():
    """``Options.sm90_attention_persistent``: the rule asks for one CTA per SM of the device, which
    loops over the 128 query tiles (the Q-release barrier and the round loop are in the kernel);
    without the option, one CTA per tile and neither."""
    from tvmfuse.options import Options, use_options

    spec = _spec(4, 1024, 1024, 4, 4, 128, "float16", causal="TopLeft")  # 8 tiles × 16 = 128
    with use_options(Options(sm90_attention_persistent=True, device="h100-pcie")):
        text = attention_primfunc(spec, SM90A).script()
    assert "T.cta_id([114])" in text and "q_empty" in text  # H100 PCIe: 114 SMs
    with use_options(Options(sm90_attention_persistent=False, device="h100-pcie")):
        plain = attention_primfunc(spec, SM90A).script()
    assert "T.cta_id([128])" in plain and "q_empty" not in plain


@pytest.mark.parametrize(("q_len", "window", "persistent"), [
    (2048, None, True),  # 16 KV tiles a query tile: persistent (measured faster)
    (2176, None, False),  # 17: one CTA per tile (causal S4096 / S8192 measured slower)
    (8192, 1024, True),  # a 1024-key window visits ≤ 10 KV tiles (measured faster)
])
def test_persistent_default_by_kv_tiles(q_len, window, persistent):
    from tvmfuse.options import Options, use_options

    spec = _spec(1, q_len, q_len, 2, 2, 128, "float16", causal="BottomRight")
    if window:
        spec = dataclasses.replace(spec, window=window)
    with use_options(Options(device="h200")):
        text = attention_primfunc(spec, SM90A).script()
    assert ("q_empty" in text) == persistent


def test_persistent_grid_is_capped_and_rounds_cover_every_tile():
    """Fewer CTAs than tiles: ceil(tiles / CTAs) rounds, tile k·grid + (bid or grid − 1 − bid);
    more CTAs than tiles: one per tile."""
    spec = _spec(2, 300, 300, 8, 2, 128, "float16", causal="TopLeft")  # 3 tiles × 16 = 48
    text = flash_attention_sm90_primfunc(spec, config=Sm90FlashConfig(persistent_ctas=7)).script()
    assert "T.cta_id([7])" in text and text.count("for kq in range(7):") == 2  # ceil(48 / 7)
    text = flash_attention_sm90_primfunc(spec, config=Sm90FlashConfig(persistent_ctas=132)).script()
    assert "T.cta_id([48])" in text
    assert "persistent_ctas" in check(spec, Sm90FlashConfig(persistent_ctas=-1))
    tiles = [k * 7 + (b if k % 2 == 0 else 6 - b) for k in range(7) for b in range(7)]
    assert sorted(t for t in tiles if t < 48) == list(range(48))
