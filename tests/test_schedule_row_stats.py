"""The row-statistics schedule rule (``tvmfuse/schedules/row_stats.py``).

NormGemmPrologue's ``layer_norm_stats`` (mean, rstd) and ``rms_norm_stats`` (rstd) kernels:

* the rule takes them (and the pipeline picks it for LayerNorm → Linear on sm90) and declines
  functions that are not row statistics (a whole LayerNorm, a plain row sum, CPU targets);
* on the CPU, the scheduled function with its thread bindings made serial computes what the
  unscheduled one computes;
* nvcc builds the CUDA source for sm_90a without spills; the SASS reads x with vector loads only
  (16-byte; 8-byte for 4100-wide fp16 rows), stores each statistic once per row, and has one rsqrt;
* on the GPU (``gpu`` marker), the statistics match numpy in float64 on random inputs.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax, te

from tests.cuda_tools import needs_nvcc
from tests.test_schedules_memory_bound import _serial, prim_funcs
from tvmfuse import pipeline
from tvmfuse.build.inspect import fatbin_sass
from tvmfuse.build.nvcc import compile_fatbin
from tvmfuse.passes.norm_gemm import row_stats_te
from tvmfuse.schedules import RULE_ATTR, RowStats, gpu_rules
from tvmfuse.targets import get_target

SM90 = get_target("sm90")
CPU = get_target("cpu")
EPS = 1e-5


def stats_func(shape: tuple[int, ...], dtype: str, centered: bool) -> tvm.tirx.PrimFunc:
    """``layer_norm_stats`` (centered) or ``rms_norm_stats`` of x, as NormGemmPrologue makes it."""
    x = te.placeholder(shape, dtype, name="x")
    out = row_stats_te(x, EPS, centered)
    return te.create_prim_func([x, *(out if centered else [out])])


def schedule(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc | None:
    target = SM90.tvm_target()
    with target:
        sch = RowStats().apply(func, target, False)
    return None if sch is None else sch.mod["main"]


def reference(x: np.ndarray, centered: bool) -> list[np.ndarray]:
    """mean, rstd (or rstd) over the last axis in float64, shapes (..., 1)."""
    x = x.astype(np.float64)
    if centered:
        mean = x.mean(-1, keepdims=True)
        return [mean, 1 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + EPS)]
    return [1 / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)]


CASES = [((8192, 4096), "float16"), ((7, 4100), "float16"), ((2, 5, 768), "float16"),
         ((64, 4096), "float32"), ((37, 96), "float32")]
IDS = ["x".join(map(str, s)) + "-" + d for s, d in CASES]


# ---------------------------------------------------------------------------------------------
# which functions the rule takes


@pytest.mark.parametrize("centered", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("shape, dtype", CASES, ids=IDS)
def test_rule_takes_stats(shape, dtype, centered):
    scheduled = schedule(stats_func(shape, dtype, centered))
    assert scheduled is not None and scheduled.attrs[RULE_ATTR] == "row_stats"
    assert tvm.s_tir.analysis.verify_well_formed(tvm.IRModule({"main": scheduled}))


def test_rule_declines_other_functions():
    n = 256
    x = relax.Var("x", relax.TensorType((64, n), "float16"))
    w = relax.Var("w", relax.TensorType((n,), "float16"))
    b = relax.Var("b", relax.TensorType((n,), "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.layer_norm(x, w, b, axes=[-1], epsilon=EPS))  # rows out
            s = bb.emit(relax.op.sum(x, axis=[-1]))  # a reduction with no row scalar after it
            e = bb.emit(relax.op.add(x, w))  # elementwise
            out = bb.emit_output((y, s, e))
        bb.emit_func_output(out)
    funcs = prim_funcs(pipeline.lower(bb.get(), CPU))
    assert len(funcs) == 3
    for name, func in funcs.items():
        assert schedule(func) is None, name
    # CPU targets are not the rule's.
    assert RowStats().apply(stats_func((8, 256), "float32", True), CPU.tvm_target(), False) is None


@pytest.mark.parametrize("centered", [True, False], ids=["layer", "rms"])
def test_pipeline_uses_rule_for_norm_linear(centered):
    """LayerNorm / RMSNorm → Linear on sm80: the stats kernel is row_stats, the GEMM applies them
    (on sm90 the wgmma GEMM computes them itself: tests/test_schedule_gemm_sm90_stats.py)."""
    rng = np.random.default_rng(0)
    m, k, n = 256, 1024, 512
    x = relax.Var("x", relax.TensorType((m, k), "float16"))
    g = relax.const(rng.normal(1, 0.1, k).astype("float16"))
    w = relax.const((rng.standard_normal((k, n)) / np.sqrt(k)).astype("float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            if centered:
                beta = relax.const(rng.normal(0, 0.1, k).astype("float16"))
                h = bb.emit(relax.op.nn.layer_norm(x, g, beta, axes=[-1], epsilon=EPS))
            else:
                h = bb.emit(relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=EPS))
            out = bb.emit_output(bb.emit(relax.op.matmul(h, w)))
        bb.emit_func_output(out)
    rules = {name: f.attrs.get(RULE_ATTR) for name, f in prim_funcs(
        pipeline.lower(bb.get(), get_target("sm80"))).items()}
    stats = "layer_norm_stats" if centered else "rms_norm_stats"
    assert rules.pop(stats) == "row_stats"
    assert len(rules) == 1 and "layer_norm" not in next(iter(rules)), rules


def test_rule_comes_before_dlight_reductions():
    names = [type(r).__name__ for r in gpu_rules()]
    assert names.index("RowNorm") < names.index("RowStats") < names.index("Reduction")


# ---------------------------------------------------------------------------------------------
# semantics on the CPU


@pytest.mark.parametrize("centered", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("shape, dtype", [((7, 4100), "float16"), ((2, 5, 768), "float16"),
                                          ((37, 96), "float32"), ((16, 256), "float32")])
def test_schedule_keeps_semantics(shape, dtype, centered):
    func = stats_func(shape, dtype, centered)
    scheduled = schedule(func)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    outs = [np.zeros((*shape[:-1], 1), "float32") for _ in range(2 if centered else 1)]
    want = _run_all(func, x, outs)
    got = _run_all(_serial(scheduled), x, outs)
    for g, w, r in zip(got, want, reference(x, centered)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def _run_all(func: tvm.tirx.PrimFunc, x: np.ndarray, outs: list[np.ndarray]) -> list[np.ndarray]:
    """Every output of ``func(x, *outs)``, built for the CPU, in float64."""
    lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                         target="llvm")
    tensors = [tvm.runtime.tensor(a) for a in (x, *outs)]
    lib(*tensors)
    return [t.numpy().astype(np.float64) for t in tensors[1:]]


# ---------------------------------------------------------------------------------------------
# CUDA source and SASS


def cuda_source(func: tvm.tirx.PrimFunc) -> str:
    target = SM90.tvm_target()
    kernel = func.with_attr("global_symbol", "main").with_attr("target", target)
    return tvm.tirx.build(tvm.IRModule({"main": kernel}), target=target).imports[0].inspect_source()


@needs_nvcc
@pytest.mark.parametrize("centered", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("shape, dtype, ld_bits, loads, shuffles", [
    ((8192, 4096), "float16", 128, 2, True),  # 256 threads, 2 vectors of 8 a thread
    ((7, 4100), "float16", 64, 5, False),     # 205 threads (a shared-memory tree), 5 vectors of 4
    ((2, 5, 768), "float16", 128, 3, True),   # a warp a row, 4 rows a block
    ((64, 4096), "float32", 128, 2, True),    # 512 threads, 2 vectors of 4
])
def test_sass(shape, dtype, ld_bits, loads, shuffles, centered, tmp_path):
    source = cuda_source(schedule(stats_func(shape, dtype, centered)))
    sass = fatbin_sass(compile_fatbin(source, SM90, tmp_path))["sm_90a"]
    # x is read once: `loads` vector loads a thread, nothing else.
    assert re.findall(r"LDG\.E(?:\.\w+)?", sass) == [f"LDG.E.{ld_bits}"] * loads
    # Each statistic is one 32-bit store, by one thread of the row.
    assert re.findall(r"STG\.E(?:\.\w+)?", sass) == ["STG.E"] * (2 if centered else 1)
    assert ("SHFL.DOWN" in sass) == shuffles
    log = (tmp_path / "kernels.ptxas.log").read_text()
    assert set(re.findall(r"(\d+) bytes spill", log)) <= {"0"}, log


# ---------------------------------------------------------------------------------------------
# GPU numerics


@pytest.mark.gpu
@pytest.mark.parametrize("centered", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("shape", [(8192, 4096), (7, 4100), (2, 5, 768), (2, 128, 1024)], ids=str)
def test_gpu_matches_float64(shape, centered):
    import torch

    major, minor = torch.cuda.get_device_capability()
    target = tvm.target.Target({"kind": "cuda", "arch": f"sm_{major}{minor}"}, host={"kind": "llvm"})
    func = stats_func(shape, "float16", centered)
    with target:
        sch = RowStats().apply(func, target, False)
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=target)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype("float16")  # a nonzero mean
    args = [torch.from_numpy(x).cuda()] + [
        torch.zeros(*shape[:-1], 1, device="cuda") for _ in range(2 if centered else 1)]
    lib["main"](*[tvm.runtime.from_dlpack(a) for a in args])
    for got, want in zip(args[1:], reference(x, centered)):
        got = got.cpu().double().numpy()
        err = np.abs(got - want).max() / np.abs(want).max()
        print(f"{shape} {'layer' if centered else 'rms'}: max rel err {err:.2e}")
        assert err < 1e-5
