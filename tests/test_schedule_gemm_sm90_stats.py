"""Sm90GemmRowStats: a norm's row statistics computed inside the sm_90a wgmma GEMM's main loop.

CPU: which statistics calls go away (sm_90a, fp16 / bf16) and which stay with a reason (sm80,
fp32, a statistic read elsewhere); the MLP block's launch count; the kernels compile for sm_90a
to HGMMA with no spills. GPU: LayerNorm / RMSNorm + Linear and the MLP block against float64 torch
on inputs whose mean is about 3 standard deviations (the cancellation case of E[x²] − mean²).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from tvm import tirx

import tvmfuse
from models.decoder_layer import RMSNorm
from tests.cuda_tools import check_vs_float64, needs_nvcc
from tests.test_schedule_gemm_sm90 import _ptxas_kernels
from tvmfuse.frontend import import_model
from tvmfuse.kernels.gemm.sm90 import GemmConfig, GemmProblem, RowStats, check, standalone
from tvmfuse.options import Options, use_options
from tvmfuse.pipeline import lower
from tvmfuse.report import analyze, stock_kernel_count
from tvmfuse.rules.gemm_sm90_stats import IN_LOOP_ATTR, KEPT_ATTR, row_stats_of
from tvmfuse.targets import get_target


class NormLinear(nn.Module):
    """``linear(norm(x))``: x (M, K) → (M, N); norm LayerNorm or (Llama's) RMSNorm over K."""

    def __init__(self, norm: str, k: int, n: int, bias: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(k) if norm == "layer" else RMSNorm(k)
        self.linear = nn.Linear(k, n, bias=bias)
        with torch.no_grad():  # non-trivial γ (and β): folding them into W is exercised too
            self.norm.weight.normal_(1.0, 0.1)
            if norm == "layer":
                self.norm.bias.normal_(0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


class NormLinearAndNorm(NormLinear):
    """``(linear(norm(x)), norm(x))``: the normed tensor has a second user."""

    def forward(self, x: torch.Tensor):
        h = self.norm(x)
        return self.linear(h), h * 2


def _model(norm: str, m: int, k: int, n: int, dtype, cls=NormLinear, seed: int = 0):
    torch.manual_seed(seed)
    module = cls(norm, k, n).to(dtype).eval()
    x = (3.0 + torch.randn(m, k)).to(dtype)  # mean ≈ 3·std
    return module, (x,)


def _lowered(module, inputs, target: str = "sm90") -> dict:
    mod = lower(import_model(module, inputs).mod, get_target(target))
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sm90_gemm_computes_the_statistics(norm, dtype):
    """sm_90a, 16-bit: no statistics kernel is left; the GEMM lost the two (one) stats params."""
    funcs = _lowered(*_model(norm, 256, 512, 384, dtype))
    assert not any(name.endswith("norm_stats") for name in funcs), sorted(funcs)
    (gemm,) = [f for f in funcs.values() if f.attrs.get(IN_LOOP_ATTR) is not None]
    before, stats = (str(s) for s in gemm.attrs[IN_LOOP_ATTR])
    assert stats == ("layer_norm_stats" if norm == "layer" else "rms_norm_stats")
    assert "matmul" in before
    # x, W', mean, colsum, rstd, shift, bias, out → without mean, rstd; RMS: x, W', rstd, bias, out
    assert len(gemm.params) == (6 if norm == "layer" else 4), gemm.params
    text = gemm.script()
    assert "rsum" in text and "T.rsqrt" in text


@pytest.mark.parametrize("m, in_loop", [(16, True), (8192, False)])
def test_cost_estimate_decides(m, in_loop, monkeypatch):
    """A decode-sized GEMM computes its statistics; an 8192x4096->4096 projection keeps the
    statistics kernel (measured: 12 % of its main loop > the 20 us kernel), with the estimate as
    the reason; ``sm90_in_loop_stats_always`` moves them anyway."""
    funcs = _lowered(*_model("layer", m, 4096, 4096, torch.float16))
    assert ("layer_norm_stats" not in funcs) == in_loop, sorted(funcs)
    if not in_loop:
        assert "estimated" in str(funcs["layer_norm_stats"].attrs[KEPT_ATTR])
        with use_options(Options(sm90_in_loop_stats_always=True)):
            forced = _lowered(*_model("layer", m, 4096, 4096, torch.float16))
        assert "layer_norm_stats" not in forced


@pytest.mark.parametrize("target, dtype, why", [
    ("sm80", torch.float16, "float16 GEMM"),  # the sm80 GEMM has no in-loop statistics
])
def test_statistics_kernel_stays_elsewhere(target, dtype, why):
    """(fp32 GEMMs compute theirs in the SIMT kernel: tests/test_schedule_gemm_simt_stats.py.)"""
    funcs = _lowered(*_model("layer", 256, 512, 384, dtype), target=target)
    assert "layer_norm_stats" in funcs
    assert not any(f.attrs.get(IN_LOOP_ATTR) is not None for f in funcs.values())
    kept = funcs["layer_norm_stats"].attrs.get(KEPT_ATTR)
    assert (kept is None) if why is None else why in str(kept)


def test_statistic_with_another_user_is_kept():
    """norm(x) also returned: NormGemmPrologue leaves the norm, so no statistics call at all;
    either way nothing is computed twice and the outputs' kernels stay as they were."""
    funcs = _lowered(*_model("layer", 256, 512, 384, torch.float16, NormLinearAndNorm))
    assert not any(f.attrs.get(IN_LOOP_ATTR) is not None for f in funcs.values())


def test_two_chain_tiles_refuse_in_loop_statistics():
    """A tile with two 64-row accumulator chains per warpgroup cannot compute the statistics: the
    kernel's check says so (the caller keeps the statistics kernel), the generator refuses it."""
    prob = GemmProblem(512, 256, 512, "float16", "float16", "nt")
    two_chains = GemmConfig(bm=128, bn=128, wg_rows=128)
    stats = RowStats(True, 1e-5)
    assert check(prob, two_chains) is None
    assert "one 64-row chain" in check(prob, two_chains, stats)
    with pytest.raises(ValueError, match="one 64-row chain"):
        standalone(prob, two_chains, stats)


def test_recognises_only_the_statistics_functions():
    from tvm import relax

    from tvmfuse.passes.norm_gemm import stats_function as _stats_function

    ty = relax.TensorType((64, 256), "float16")
    assert row_stats_of(_stats_function(ty, 1e-5, True)) == RowStats(True, 1e-5)
    assert row_stats_of(_stats_function(ty, 1e-6, False)) == RowStats(False, 1e-6)
    funcs = _lowered(*_model("layer", 256, 512, 384, torch.float16), target="sm80")
    for name, func in funcs.items():
        if name != "layer_norm_stats" and func.attrs.get("tvmfuse.rule") is None:
            assert row_stats_of(func) is None, name


def test_mlp_block_launches_at_most_half_of_stock():
    """Issue 3: the fp16 MLP block is 2 launches on sm90 (stock TVM: 5); the report says so."""
    from models import mlp_block

    module, example = mlp_block.build(dtype=torch.float16)
    mod = import_model(module, example).mod
    spec = get_target("sm90")
    report = analyze(mod, spec)
    stock = stock_kernel_count(mod, spec)
    names = [k["name"] for k in report["kernels"]]
    assert report["fused_kernel_count"] == 2 and 2 * report["fused_kernel_count"] <= stock, names
    first = report["kernels"][0]
    assert first["pattern"] == "norm_gemm" and first["ops"][0] == "layer_norm_stats", first
    assert first["flops"] > 0
    assert not any("_stats" in e["ops"][0] for e in report["not_fused"]), report["not_fused"]
    # sm80 keeps the statistics kernel and says why
    report80 = analyze(mod, get_target("sm80"))
    assert report80["fused_kernel_count"] == 3
    (edge,) = [e for e in report80["not_fused"] if e["ops"][0] == "layer_norm_stats"]
    assert "only the sm_90a wgmma GEMM" in edge["reason"]


@needs_nvcc
@pytest.mark.parametrize("centered, dtype, m, k, cfg", [
    (True, "float16", 1000, 328, GemmConfig()),
    (False, "bfloat16", 16, 4096, GemmConfig()),
    (True, "float16", 1000, 328, GemmConfig(stats_warps=True)),
    (False, "bfloat16", 2048, 2048, GemmConfig(stats_warps=True, cluster_m=2)),
    (False, "float16", 4096, 2048, GemmConfig(bm=256, bn=128, wg_rows=128, stats_warps=True)),
], ids=["layer-fp16", "rms-bf16", "layer-fp16-warps", "rms-bf16-warps-cluster",
        "rms-fp16-warps-256rows"])
def test_kernel_compiles_without_spills(centered, dtype, m, k, cfg, tmp_path, monkeypatch):
    """Standalone kernel with in-loop statistics (ragged M, K tail): HGMMA + TMA, 0 spills. The
    consumers' shuffles hand out the statistics; with ``stats_warps`` shared memory does."""
    import tvm

    from tvmfuse.build.inspect import fatbin_sass
    from tvmfuse.build.nvcc import compile_fatbin

    monkeypatch.setenv("TVM_COMPILE_FORCE_FALLBACK", "1")
    prob = GemmProblem(m, 512, k, dtype, dtype, "nt")
    reason = check(prob, cfg, RowStats(centered, 1e-5))
    if cfg.bm == 256:  # two 64-row chains a consumer: no in-loop statistics at all
        assert reason and "one 64-row chain" in reason
        return
    assert reason is None, reason
    func = standalone(prob, cfg, RowStats(centered, 1e-5))
    lib = tvm.compile(tvm.IRModule({"main": func}), target=get_target("sm90").tvm_target(),
                      tir_pipeline="tirx")
    src = lib.mod.imports[0].inspect_source()
    body = src[src.index("__global__"):]
    if cfg.stats_warps:  # (mean, rstd) through shared memory, two more barriers
        assert "rowstat" in body
        assert src.count("mbarrier_init") >= 2 * cfg.stages + 2  # + stats_ready, stats_free
    else:
        assert src.count("__shfl_sync") >= (4 if centered else 2)
    sass = fatbin_sass(compile_fatbin(src, get_target("sm90"), tmp_path))["sm_90a"]
    assert "HGMMA.64x256x16.F32" in sass and "UTMALDG" in sass
    assert "LDS.128" in sass  # the 16-byte shared-memory reads of the A rows
    kernels = _ptxas_kernels((tmp_path / "kernels.ptxas.log").read_text())
    assert kernels and all(spill == 0 for _, spill in kernels.values()), kernels


def test_stats_warps_take_every_statistics_call():
    """``Options(sm90_stats_warps=True)``: no cost estimate keeps a statistics kernel (the
    consumers' main loop does no extra work), so the 4-layer LM's nine RMSNorm statistics
    kernels all go into the GEMMs that read them."""
    from models import llama_lm

    module, inputs = llama_lm.build(vocab=512, hidden=1024, n_layers=2, n_heads=8, n_kv_heads=2,
                                    ffn=2816, seq=2048)
    mod = import_model(module, inputs).mod
    names = {}
    for warps in (False, True):
        with use_options(Options(sm90_stats_warps=warps)):
            names[warps] = [k["name"] for k in analyze(mod, get_target("sm90"), "float16",
                                                        stock=False)["kernels"]]
    assert sum("rms_norm_stats" in n for n in names[False]) >= 1, names[False]
    assert not any("rms_norm_stats" in n for n in names[True]), names[True]
    assert len(names[True]) == len(names[False]) - sum("rms_norm_stats" in n for n in names[False])


@needs_nvcc
def test_export_holds_the_stats_kernel(tmp_path):
    """compile → export through the pipeline: one sm_90a kernel, HGMMA, shuffles, no spills."""
    from tvmfuse.build.inspect import cuda_images, fatbin_sass

    module, inputs = _model("rms", 300, 1024, 512, torch.bfloat16)
    path = tvmfuse.compile(module, inputs, target="sm90").export(tmp_path / "m.so")
    (fmt, code), = cuda_images(path)
    sass = fatbin_sass(code)["sm_90a"]
    assert fmt == "fatbin" and "HGMMA.64x256x16.F32.BF16" in sass and "SHFL.IDX" in sass


# ---------------------------------------------------------------------------------------------
# GPU numerics against float64 torch

GPU_CASES = [(8192, 4096, 4096), (2047, 4096, 4096), (16, 4096, 4096)]


def _check(module, inputs, tmp_path, tol):
    check_vs_float64(module, inputs, "sm90", tmp_path, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [False, True], ids=["consumers", "stats_warps"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 5e-3), (torch.bfloat16, 2e-2)],
                         ids=["fp16", "bf16"])
@pytest.mark.parametrize("m, k, n", GPU_CASES, ids=["8192", "2047", "16"])
def test_gpu_norm_linear(norm, dtype, tol, m, k, n, warps, tmp_path):
    # the in-loop kernel at every size, its statistics by the consumers or by two producer warps
    with use_options(Options(sm90_in_loop_stats_always=True, sm90_stats_warps=warps)):
        _check(*_model(norm, m, k, n, dtype), tmp_path, tol)


@pytest.mark.gpu
def test_gpu_mlp_block(tmp_path):
    from models import mlp_block

    module, (x,) = mlp_block.build(batch=2, seq=1000, hidden=1024, dtype=torch.float16)
    _check(module, (x + 3,), tmp_path, 5e-3)



@pytest.mark.gpu
@pytest.mark.parametrize("warps", [False, True], ids=["consumers", "stats_warps"])
def test_gpu_decoder_layer_fp16(warps, tmp_path):
    """fp16 Llama-style layer: RMS statistics in the wide Q/K/V GEMM and in the SwiGLU pair GEMM."""
    from models import decoder_layer

    module, (x,) = decoder_layer.build(batch=2, seq=128, hidden=512, n_heads=8, n_kv_heads=2)
    module = module.half()
    with use_options(Options(sm90_stats_warps=warps)):
        _check(module, ((x + 3).half(),), tmp_path, 5e-3)


@pytest.mark.gpu
def test_gpu_llama_lm_stats_warps(tmp_path):
    """The issue-13 LM's shape class (several persistent tiles a CTA, every norm's statistics in
    a GEMM) with the statistics warps, against float64 torch."""
    from models import llama_lm

    module, inputs = llama_lm.build(vocab=2048, hidden=1024, n_layers=2, n_heads=8, n_kv_heads=2,
                                    ffn=2816, seq=2048)
    with use_options(Options(sm90_stats_warps=True)):
        _check(module, inputs, tmp_path, 5e-3)
