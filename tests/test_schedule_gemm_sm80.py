"""The sm80 tensor-core GEMM rule (``tvmfuse/rules/gemm_sm80.py``).

CPU checks:

* the pipeline schedules every fused GEMM with it by default (attribute ``"tvmfuse.rule"`` =
  ``"gemm_sm80"``): bias + GELU / ReLU, SiLU·gate, residual add, fp16 and bf16, ragged M,
  a 3-D activation, batched matmul, the norm-prologue form, decode M = 8;
* a transposed (Linear, (N, K)) weight and a (K, N) weight both take it (direct rule calls);
* GEMMs outside its form fall back to dlight, marked ``"tvmfuse.fallback"`` with the reason;
* built through tvmfuse's export path, nvcc compiles it for sm_80 + sm_90 (target ``sm80``) and
  for sm_90a; the SASS holds cp.async (LDGSTS), ldmatrix (LDSM) and mma.sync (HMMA), and ptxas
  reports no spills and no stack frame for the GEMM kernel.

GPU check (``@pytest.mark.gpu``, on the device): relative error against a float32 torch
reference on random inputs over a shape grid (4096³, ragged 2047 × 4096 × 4096, decode M =
1 / 8 / 16, a 3-D activation, bf16), through ``tvmfuse.compile`` → export → load.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, te, tirx

from tests.cuda_tools import needs_nvcc
from tvmfuse import pipeline
from tvmfuse.build.export import export_library
from tvmfuse.build.inspect import cuda_images, cuda_source, fatbin_sass, pipelined_loop
from tvmfuse.build.nvcc import compile_fatbin
from tvmfuse.options import Options, use_options
from tvmfuse.rules import RULE_ATTR, GemmSM80
from tvmfuse.rules.gemm_sm80 import FALLBACK_ATTR, GemmConfig
from tvmfuse.targets import get_target
from tvmfuse.tvm_setup import codegen_scope

SM80 = get_target("sm80")
SM90 = get_target("sm90")


# ---------------------------------------------------------------------------------------------
# graphs


def gemm_graph(m: int, n: int, k: int, dtype: str = "float16", epilogue: str = "bias_gelu",
               lead: tuple[int, ...] = (), batched_b: bool = False) -> tvm.IRModule:
    """``main(x, w, …)``: ``x (*lead, M, K) · w (K, N)`` (or ``w (*lead, K, N)``) with fp32
    accumulation, then ``epilogue``, cast back to ``dtype``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((*lead, m, k), dtype))
    w = relax.Var("w", relax.TensorType((*lead, k, n) if batched_b else (k, n), dtype))
    params = [x, w]
    extra = {}
    for name, shape in {"bias": (n,), "res": (*lead, m, n), "up": (k, n)}.items():
        extra[name] = relax.Var(name, relax.TensorType(shape, dtype))
    with bb.function("main", params + [extra[e] for e in _uses(epilogue)]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
            if "bias" in epilogue:
                y = bb.emit(relax.op.add(y, relax.op.astype(extra["bias"], "float32")))
            if epilogue.endswith("gelu"):
                y = bb.emit(relax.op.nn.gelu(y))
            elif epilogue.endswith("relu"):
                y = bb.emit(relax.op.nn.relu(y))
            elif epilogue == "silu_gate":  # silu(x·Wg) ⊙ (x·Wu): the second GEMM is an input
                up = bb.emit(relax.op.matmul(x, extra["up"], out_dtype="float32"))
                y = bb.emit(relax.op.multiply(relax.op.nn.silu(y), up))
            elif epilogue == "residual":
                y = bb.emit(relax.op.add(y, relax.op.astype(extra["res"], "float32")))
            out = bb.emit_output(bb.emit(relax.op.astype(y, dtype)))
        bb.emit_func_output(out)
    return bb.get()


def _uses(epilogue: str) -> list[str]:
    return {"bias_gelu": ["bias"], "bias_relu": ["bias"], "silu_gate": ["up"],
            "residual": ["res"], "none": []}[epilogue]


def norm_linear_graph(m: int, k: int, n: int, dtype: str = "float16", norm: str = "layer"
                      ) -> tvm.IRModule:
    """``norm(x) · W + b`` (LayerNorm or RMSNorm) with constant W, γ[, β], b: NormGemmPrologue's
    form."""
    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), dtype))
    gamma = relax.const(rng.normal(1, 0.1, k).astype(dtype))
    beta = relax.const(rng.normal(0, 0.1, k).astype(dtype))
    w = relax.const((rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype))
    b = relax.const(rng.standard_normal(n).astype(dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            if norm == "layer":
                h = bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[-1], epsilon=1e-5))
            else:
                h = bb.emit(relax.op.nn.rms_norm(x, gamma, axes=[-1], epsilon=1e-5))
            y = bb.emit(relax.op.add(relax.op.matmul(h, w), b))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def te_linear(m: int, n: int, k: int, dtype: str = "float16", kn: bool = False,
              acc: str = "float32") -> tirx.PrimFunc:
    """TE ``relu(x · Wᵀ + b)`` with W (N, K) (or W (K, N) when ``kn``)."""
    x = te.placeholder((m, k), dtype, name="x")
    w = te.placeholder((k, n) if kn else (n, k), dtype, name="w")
    b = te.placeholder((n,), dtype, name="b")
    r = te.reduce_axis((0, k), name="k")
    mm = te.compute((m, n), lambda i, j: te.sum(
        x[i, r].astype(acc) * (w[r, j] if kn else w[j, r]).astype(acc), axis=r), name="matmul")
    y = te.compute((m, n), lambda i, j: te.max(mm[i, j] + b[j].astype(acc),
                                               tirx.const(0, acc)).astype(dtype), name="relu")
    return te.create_prim_func([x, w, b, y])


def kernels(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc) and not gv.name_hint.startswith("vm.")}


def gemm_kernels(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {name: f for name, f in kernels(mod).items() if "matmul" in name}


# ---------------------------------------------------------------------------------------------
# the pipeline picks the rule


PIPELINE_CASES = {
    "fp16-bias-gelu": lambda: gemm_graph(256, 512, 256),
    "bf16-bias-relu": lambda: gemm_graph(256, 512, 256, "bfloat16", "bias_relu"),
    "ragged-m-silu-gate": lambda: gemm_graph(200, 256, 128, epilogue="silu_gate"),
    "residual-3d": lambda: gemm_graph(64, 256, 128, epilogue="residual", lead=(2,)),
    "batched": lambda: gemm_graph(128, 128, 64, epilogue="none", lead=(3,), batched_b=True),
    "decode-m8": lambda: gemm_graph(8, 512, 256, epilogue="bias_relu"),
    "norm-prologue": lambda: norm_linear_graph(128, 256, 512),
    "norm-prologue-rms": lambda: norm_linear_graph(128, 256, 512, norm="rms"),
}


@pytest.mark.parametrize("case", list(PIPELINE_CASES))
def test_pipeline_uses_rule(case):
    lowered = pipeline.lower(PIPELINE_CASES[case](), SM80)
    gemms = gemm_kernels(lowered)
    assert gemms, f"no fused GEMM kernel in {list(kernels(lowered))}"
    for name, func in gemms.items():
        assert func.attrs.get(RULE_ATTR) == "gemm_sm80", (name, func.attrs.get(FALLBACK_ATTR))


def test_norm_prologue_epilogue_reads_row_stats():
    """The norm-prologue GEMM applies per-row statistics and per-column vectors in its
    epilogue: its fused kernel reads (M, 1) row stats and (N,) vectors besides x and W."""
    lowered = pipeline.lower(norm_linear_graph(128, 256, 512), SM80)
    (func,) = gemm_kernels(lowered).values()
    shapes = [tuple(int(d) for d in p.shape) for p in func.params]
    assert (128, 1) in shapes and (512,) in shapes, shapes


@pytest.mark.parametrize("kn", [False, True], ids=["weight-NK", "weight-KN"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rule_layouts(kn, dtype):
    func = te_linear(192, 256, 128, dtype, kn)
    sch = GemmSM80().apply(func, SM80.tvm_target(), False)
    assert sch is not None and sch.mod["main"].attrs[RULE_ATTR] == "gemm_sm80"
    text = sch.mod.script()
    assert "ptx_legacy.ldmatrix" in text and "ptx_legacy.mma" in text
    assert ("bf16" if dtype == "bfloat16" else "fp16") in text
    assert "software_pipeline_async_stages" in text


def _cuda_source(mod: tvm.IRModule, target) -> str:
    """The CUDA source ``tvm.compile`` generates for ``mod`` (kept as source, nvcc not run)."""
    with codegen_scope():  # patches registered, CUDA kept as source, BUILD_CONFIG (as export does)
        source = cuda_source(tvm.compile(mod, target=target))
    assert source is not None, "no CUDA module"
    return source


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kn_weight_uses_ldmatrix_trans(dtype):
    """A (K, N) weight is loaded with ``ldmatrix.trans``. The bf16 intrinsics are re-parsed from
    the fp16 ones; an ldmatrix call typed int8 there made codegen emit its int8 gather loop
    (shared offset taken as a stride: an illegal memory access on the GPU, 2047×1024×2048 bf16
    with W a model input)."""
    sch = GemmSM80().apply(te_linear(128, 128, 256, dtype, kn=True), SM80.tvm_target(), False)
    assert sch.mod["main"].attrs[RULE_ATTR] == "gemm_sm80"
    calls = []
    tvm_ffi.structural_map(sch.mod["main"].body, [((tvm.ir.Call,), lambda c: calls.append(c)
                                                    or c)])
    ldmatrix = [c for c in calls if getattr(c.op, "name", "") == "tirx.ptx_legacy.ldmatrix"]
    assert ldmatrix and all(str(c.ty) == dtype for c in ldmatrix), [str(c.ty) for c in ldmatrix]
    source = _cuda_source(sch.mod, SM80.tvm_target())
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in source
    assert "for (int i = 0; i < 16; ++i)" not in source, "the int8 ldmatrix gather loop"


def _main_loop(source: str) -> str:
    """The pipelined K loop's body (``tvmfuse.build.inspect.pipelined_loop``)."""
    loop = pipelined_loop(source)
    assert loop is not None, "no cp.async loop in the CUDA source"
    return loop


@pytest.mark.parametrize("block_k, stages", [(64, 3), (64, 4), (32, 4)])
def test_one_barrier_per_k_tile(block_k, stages):
    """The main loop holds one ``__syncthreads``, after the wait for the tile the next
    fragments come from and after this tile's k-steps: copies, commit, k-steps, wait, barrier,
    next tile's first fragments (TVM's ThreadSync gave two: one before the copies). With
    ``block_k`` 32 the k-steps are no loop but a straight run of ldmatrix / mma."""
    cfg = GemmConfig(block_k=block_k, stages=stages, one_barrier=True)
    sch = GemmSM80(config=cfg).apply(te_linear(256, 256, 512), SM80.tvm_target(), False)
    loop = _main_loop(_cuda_source(sch.mod, SM80.tvm_target()))
    assert loop.count("__syncthreads()") == 1, loop.count("__syncthreads()")
    order = [loop.index("commit_group();"), loop.index("mma.sync"),
             loop.index(f"wait_group_{stages - 2}();"), loop.index("__syncthreads();")]
    assert order == sorted(order), order
    assert loop.index("ldmatrix", order[-1]) > order[-1]  # next tile's fragments after it


def test_accumulator_rows_padded_in_shared():
    """The fp32 accumulators staged in shared memory have rows of ``block_n + C_ROW_PAD``
    floats (a 4-way bank conflict on the fragment stores without: H200 4096³ 0.3168 → 0.3120
    ms), and the epilogue lanes read them in 16-byte pieces of that row stride."""
    cfg = GemmConfig(one_barrier=True)  # block_n 128
    sch = GemmSM80(config=cfg).apply(te_linear(256, 256, 512), SM80.tvm_target(), False)
    source = _cuda_source(sch.mod, SM80.tvm_target())
    stride = cfg.block_n + Options().sm80_c_row_pad
    stores = [ln for ln in source.splitlines() if "((float*)buf_dyn_shmem_ptr)[" in ln and "] =" in ln]
    assert stores and all(f"* {stride})" in ln for ln in stores), stores[:2]
    reads = [ln for ln in source.splitlines() if "*(float4*)(((float*)buf_dyn_shmem_ptr)" in ln]
    assert reads and all(f"* {stride})" in ln for ln in reads), reads[:2]


def test_epilogue_from_registers(monkeypatch):
    """``Options.sm80_epilogue_from_registers``: bias + ReLU on the fragments, ``half2`` stores straight to
    the output, no fp32 staging in shared memory; a ragged M (padded C) keeps the staged
    epilogue and the rule (not dlight's fallback)."""
    with use_options(Options(sm80_epilogue_from_registers=True)):
        sch = GemmSM80().apply(te_linear(256, 256, 512), SM80.tvm_target(), False)
        ragged = GemmSM80().apply(te_linear(200, 256, 512), SM80.tvm_target(), False)
    source = _cuda_source(sch.mod, SM80.tvm_target())
    assert "(float*)buf_dyn_shmem_ptr" not in source
    assert "*(half2*)(relu_ptr" in source
    attrs = ragged.mod["main"].attrs
    assert attrs.get(RULE_ATTR) == "gemm_sm80", attrs.get(FALLBACK_ATTR)


def test_two_barriers_without_the_rewrite():
    """``one_barrier=False`` (the default) keeps TVM's loop: a barrier before the copies and
    one after the wait, the k-steps last (the layout the rewrite recognises)."""
    cfg = GemmConfig(one_barrier=False)
    sch = GemmSM80(config=cfg).apply(te_linear(256, 256, 512), SM80.tvm_target(), False)
    loop = _main_loop(_cuda_source(sch.mod, SM80.tvm_target()))
    assert loop.count("__syncthreads()") == 2
    assert loop.index("__syncthreads()") < loop.index("cp_async")


@pytest.mark.parametrize("func, reason", [
    (lambda: te_linear(128, 128, 128, acc="float16"), "accumulator dtype float16"),
    (lambda: te_linear(128, 128, 100), "K=100"),
], ids=["fp16-accumulate", "k-not-multiple-of-8"])
def test_fallback_is_marked(func, reason):
    sch = GemmSM80().apply(func(), SM80.tvm_target(), False)
    assert sch is not None, "a GEMM the rule leaves must still get dlight's schedule"
    attrs = sch.mod["main"].attrs
    assert RULE_ATTR not in attrs and reason in attrs[FALLBACK_ATTR]


@needs_nvcc
def test_sm90a_fallback_keeps_tensor_cores(tmp_path):
    """A GEMM this rule leaves (here a symbolic M) gets dlight's Matmul; on sm_90a too that is its
    wmma schedule (dlight reads ``sm_90a`` as no tensor cores unless given the digits):
    HMMA in the SASS."""
    m = tirx.Var("m", "int64")
    k_, n_ = tirx.IntImm("int64", 512), tirx.IntImm("int64", 768)
    a = te.placeholder((m, k_), "float16", "a")
    w = te.placeholder((n_, k_), "float16", "w")
    k = te.reduce_axis((0, k_), "k")
    c = te.compute((m, n_), lambda i, j: te.sum(a[i, k].astype("float32") * w[j, k].astype(
        "float32"), axis=k), name="c")
    y = te.compute((m, n_), lambda i, j: c[i, j].astype("float16"), name="y")
    target = get_target("sm90")
    with target.tvm_target():
        sch = GemmSM80().apply(te.create_prim_func([a, w, y]), target.tvm_target(), False)
    assert "symbolic" in str(sch.mod["main"].attrs[FALLBACK_ATTR])
    source = _cuda_source(sch.mod, target.tvm_target())
    assert "wmma" in source
    sass = fatbin_sass(compile_fatbin(source, target, tmp_path))
    assert any("HMMA" in text for text in sass.values())


@pytest.mark.gpu
def test_sm90a_fallback_numerics_on_the_gpu(tmp_path):
    """H200: a Linear with K = 100 (no 16-byte TMA / cp.async rows: both tensor-core rules leave
    it) runs dlight's wmma schedule; against torch in fp32."""
    import torch

    import tvmfuse

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(100, 256), torch.nn.ReLU()).half().eval()
    x = torch.randn(512, 100, dtype=torch.float16)
    lib = tvmfuse.compile(module, (x,), target="sm90")
    run = tvmfuse.load(lib.export(tmp_path / "k100.so"), device="cuda")
    got = torch.as_tensor(run(x.cuda())).cpu().double()
    ref = module.float()(x.float()).double()
    assert float((got - ref).norm() / ref.norm()) < 2e-3


def test_not_a_gemm():
    x = te.placeholder((64, 64), "float16", name="x")
    y = te.compute((64, 64), lambda i, j: x[i, j] * 2, name="y")
    assert GemmSM80().apply(te.create_prim_func([x, y]), SM80.tvm_target(), False) is None


def test_config_checks():
    with pytest.raises(ValueError, match="warp tile"):
        GemmConfig(block_m=128, warp_m=48).check()
    with pytest.raises(ValueError, match="stages"):
        GemmConfig(stages=1).check()


# ---------------------------------------------------------------------------------------------
# CUDA: nvcc, SASS, resources


def _check_sass(sass: str, log: str, kernel: str) -> None:
    for op in ("LDGSTS", "LDSM", "HMMA"):
        assert op in sass, f"no {op} in the SASS"
    lanes = Options().sm80_epilogue_lane_elems  # fp16 outputs per lane and store: 4 → 8 bytes
    store = "STG.E.64" if lanes == 4 else "STG.E.128"
    assert store in sass, f"the epilogue's output is not stored with {store} vectors"
    report = log[log.index(f"Function properties for {kernel}"):]
    report = report[:report.index("Compile time")]
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report), \
        report


@pytest.mark.parametrize("m, n, batch, want", [
    (4096, 4096, 1, "large"),  # 16 × 32 tiles of 256 × 128
    (2047, 4096, 1, "large"),  # 8 × 32 = 256 blocks
    (512, 512, 8, "default"),  # 2 × 4 × 8 = 64 blocks: 128 × 128 tiles keep the SMs busy
    (1024, 2048, 1, "default"),  # 4 × 16 = 64
    (16, 4096, 1, "small"),
])
def test_pick_config(m, n, batch, want):
    from tvmfuse.rules.gemm_sm80 import (
        DEFAULT_CONFIG,
        LARGE_CONFIG,
        SMALL_M_CONFIG,
        _Gemm,
    )

    gemm = _Gemm(None, "float16", False, m, n, 4096, batch)
    expect = {"large": LARGE_CONFIG, "default": DEFAULT_CONFIG, "small": SMALL_M_CONFIG}[want]
    assert GemmSM80().pick_config(gemm) == expect
    assert GemmSM80(config=DEFAULT_CONFIG).pick_config(gemm) == (
        SMALL_M_CONFIG if want == "small" else DEFAULT_CONFIG)


def test_stages_fit_short_k():
    """Fewer K tiles than the pipeline's prologue needs: the stages shrink (K = 64 built with 3
    stages left ``cp.async.wait_group`` with a non-constant count and CUDA codegen failed)."""
    from tvmfuse.rules.gemm_sm80 import DEFAULT_CONFIG, SMALL_M_CONFIG, _fit_stages

    assert _fit_stages(DEFAULT_CONFIG, 4096) == DEFAULT_CONFIG
    assert _fit_stages(DEFAULT_CONFIG, 128).stages == 3  # two tiles fill a 3-stage prologue
    assert _fit_stages(DEFAULT_CONFIG, 64).stages == 2
    assert _fit_stages(SMALL_M_CONFIG, 256).stages == 3  # 128-wide K tiles, two of them


@pytest.mark.parametrize("m, k", [(32, 64), (16, 256)])
def test_short_k_generates_cuda(m, k):
    """Those shapes go through CUDA codegen (source kept, nvcc not needed)."""
    lowered = pipeline.lower(gemm_graph(m, 128, k, "float16"), SM80)
    assert gemm_kernels(lowered)
    pipeline.build(lowered, SM80)  # raised "codegen for target sm80 failed" before


def _waits_before_commit(source: str) -> list[int]:
    """Lines of ``cp.async.wait_group`` calls reached with cp.async copies issued since the last
    ``commit_group`` (text order): such copies belong to no group, and the wait does not wait."""
    bad, pending = [], 0
    for n, line in enumerate(source.splitlines()):
        if "cp_async_commit_group" in line:
            pending = 0
        elif "cp_async_wait_group" in line:
            if pending:
                bad.append(n)
        elif re.search(r"ptx_cp_async\w*\(", line):
            pending += 1
    return bad


@pytest.mark.parametrize("m, n, k", [(32, 128, 64), (256, 128, 64), (256, 256, 4096), (16, 128, 256)])
def test_async_copies_committed_before_waiting(m, n, k):
    """Every cp.async copy is in a committed group when a wait_group runs. With one K tile
    (K = 64 under 128-wide tiles) TVM's pipeline committed the group only after the first
    ldmatrix, which then raced the copies (H200: batched QKᵀ with K = 64 0.5 off)."""
    lowered = pipeline.lower(gemm_graph(m, n, k, "float16"), SM80)
    source = cuda_source(pipeline.build(lowered, SM80))
    assert "cp_async" in source or k <= 128
    assert _waits_before_commit(source) == []


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_export_sm80_sass(dtype, tmp_path):
    """Target sm80 through the export path: sm_80 and sm_90 SASS of the GEMM kernel."""
    lowered = pipeline.lower(gemm_graph(256, 512, 256, dtype), SM80)
    (name,) = gemm_kernels(lowered)
    lib = export_library(pipeline.build(lowered, SM80), tmp_path / "gemm.so", SM80, {},
                         workdir=str(tmp_path))
    (fmt, fatbin), = cuda_images(lib)
    assert fmt == "fatbin"
    sass = fatbin_sass(fatbin)
    log = (tmp_path / "kernels.ptxas.log").read_text()
    for arch in ("sm_80", "sm_90"):
        _check_sass(sass[arch], log, f"{name}_kernel")


@needs_nvcc
@pytest.mark.parametrize("large", [False, True], ids=["128x128", "256x128"])
def test_sm90a_sass(large, tmp_path):
    """The same schedule built for sm_90a (what target sm90 runs when the wgmma rule passes),
    with the 4-warp tile and the 8-warp 256 × 128 one (no spills at 8 warps either)."""
    from tvmfuse.rules.gemm_sm80 import LARGE_CONFIG, TILE_ATTR

    func = te_linear(512, 512, 256, kn=False)
    target = SM90.tvm_target()
    sch = GemmSM80(config=LARGE_CONFIG if large else None).apply(func, target, False)
    assert sch.mod["main"].attrs[TILE_ATTR].startswith("256x128" if large else "128x128")
    source = _cuda_source(sch.mod, target)
    sass = fatbin_sass(compile_fatbin(source, SM90, tmp_path))["sm_90a"]
    _check_sass(sass, (tmp_path / "kernels.ptxas.log").read_text(), "main_kernel")


# ---------------------------------------------------------------------------------------------
# GPU numerics (device)

GPU_GRID = [  # (lead, M, N, K, dtype)
    ((), 4096, 4096, 4096, "float16"),
    ((), 2047, 2048, 2048, "float16"),  # ragged M
    ((), 1, 4096, 4096, "float16"),  # decode: dlight GEMV (M = 1 is no GEMM to the rule)
    ((), 8, 4096, 4096, "float16"),  # decode: the 16-row tile
    ((), 16, 4096, 4096, "float16"),
    ((4,), 256, 1024, 512, "float16"),  # 3-D activation: batch folded into M
    ((), 2047, 1024, 2048, "bfloat16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lead, m, n, k, dtype", GPU_GRID,
                         ids=[f"{'x'.join(map(str, g[0] + g[1:4]))}-{g[4]}" for g in GPU_GRID])
def test_gpu_numerics(lead, m, n, k, dtype, tmp_path):
    import torch

    import tvmfuse

    class LinearReLU(torch.nn.Module):
        def forward(self, x, w, b):
            return torch.relu(torch.nn.functional.linear(x, w, b))

    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randn(*lead, m, k, generator=gen).to(tdt),
              (torch.randn(n, k, generator=gen) / k ** 0.5).to(tdt),
              torch.randn(n, generator=gen).to(tdt))
    lib = tvmfuse.compile(LinearReLU(), inputs, target="sm80")
    model = tvmfuse.load(lib.export(tmp_path / "m.so"), device="cuda")
    out = model(*[t.cuda() for t in inputs])
    ref = LinearReLU()(*[t.cuda().float() for t in inputs])
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < (2e-2 if dtype == "float16" else 5e-2), err
