"""CPU checks of the memory-bound schedule rules (``tvmfuse/rules/row_norm.py``, ``elementwise.py``).

Per graph (LayerNorm, RMSNorm, softmax with and without scale + mask, an add → mul → gelu → cast
chain, and an HF-style RMSNorm spelled out with ``mean(keepdim=True)``):

* which rule scheduled each fused PrimFunc (the ``"tvmfuse.rule"`` attribute),
* the CUDA source has 16-byte vector types, nvcc compiles it without spills, and the SASS holds
  128-bit global loads and stores (``LDG.E.128`` / ``STG.E.128``; 64-bit where a row of 4100 fp16
  values only allows 8-byte alignment),
* the schedules keep the function's semantics: the scheduled PrimFunc is well formed, and with its
  thread bindings turned into serial loops it computes, on the CPU, what the unscheduled PrimFunc
  computes (GPU numerics: ``tests/test_gpu_memory_bound.py`` on the device).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import tvm
from tvm import relax

from tests.cuda_tools import needs_nvcc
from tvmfuse import pipeline
from tvmfuse.build.inspect import cuda_source as find_cuda_source
from tvmfuse.build.inspect import fatbin_sass
from tvmfuse.build.nvcc import compile_fatbin
from tvmfuse.options import Options, use_options
from tvmfuse.rules import RULE_ATTR, Elementwise, RowNorm, gpu_rules
from tvmfuse.rules import elementwise as ew_rule
from tvmfuse.rules.row_norm import choose_threads
from tvmfuse.targets import get_target

SM90 = get_target("sm90")
CPU = get_target("cpu")


# ---------------------------------------------------------------------------------------------
# graphs


def graph(kind: str, shape: tuple[int, ...], dtype: str) -> tvm.IRModule:
    """A one-output Relax function ``main(x, w, b[, mask])`` of the given kind."""
    n = shape[-1]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    w = relax.Var("w", relax.TensorType((n,), dtype))
    b = relax.Var("b", relax.TensorType((n,), dtype))
    params = [x, w, b]
    if kind == "softmax_scale_mask":
        mask = relax.Var("mask", relax.TensorType(shape[-2:], dtype))
        params.append(mask)
    with bb.function("main", params):
        with bb.dataflow():
            if kind == "layer_norm":
                y = bb.emit(relax.op.nn.layer_norm(x, w, b, axes=[-1], epsilon=1e-5))
            elif kind == "rms_norm":
                y = bb.emit(relax.op.nn.rms_norm(x, w, axes=[-1], epsilon=1e-6))
            elif kind == "rms_norm_hf":  # x * rsqrt(mean(x², -1, keepdim) + eps) * w, in fp32
                xf = bb.emit(relax.op.astype(x, "float32"))
                ms = bb.emit(relax.op.mean(relax.op.multiply(xf, xf), axis=[-1], keepdims=True))
                r = bb.emit(relax.op.rsqrt(relax.op.add(ms, relax.const(1e-6, "float32"))))
                y = bb.emit(relax.op.multiply(relax.op.astype(relax.op.multiply(xf, r), dtype), w))
            elif kind == "softmax":
                y = bb.emit(relax.op.nn.softmax(x, axis=-1))
            elif kind == "softmax_scale_mask":
                s = bb.emit(relax.op.add(relax.op.multiply(x, relax.const(0.125, dtype)), mask))
                y = bb.emit(relax.op.nn.softmax(s, axis=-1))
            elif kind == "elementwise":  # add → mul → gelu → cast
                a = bb.emit(relax.op.add(x, w))
                a = bb.emit(relax.op.multiply(a, b))
                a = bb.emit(relax.op.nn.gelu(a))
                y = bb.emit(relax.op.astype(a, "float32" if dtype == "float16" else "float16"))
            else:
                raise ValueError(kind)
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def prim_funcs(mod: tvm.IRModule) -> dict[str, tvm.tirx.PrimFunc]:
    """The kernels of a lowered module (not the VM's shape functions)."""
    return {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and not gv.name_hint.startswith("vm.")}


def cuda_source(executable) -> str:
    source = find_cuda_source(executable)
    assert source is not None, "no CUDA module in the executable"
    return source


# ---------------------------------------------------------------------------------------------
# CUDA: rule choice, vector types, SASS, resources

# (kind, shape, dtype, {kernel: rule}, bits of the global loads, bits of the global stores)
CUDA_CASES = [
    ("layer_norm", (64, 4096), "float16", {"layer_norm": "row_norm"}, 128, 128),
    ("layer_norm", (32, 4100), "float16", {"layer_norm": "row_norm"}, 64, 64),  # 8-byte aligned rows
    ("layer_norm", (64, 4096), "float32", {"layer_norm": "row_norm"}, 128, 128),
    ("rms_norm", (2, 32, 4096), "float16", {"rms_norm": "row_norm"}, 128, 128),
    ("rms_norm", (32, 4100), "float32", {"rms_norm": "row_norm"}, 128, 128),
    ("softmax", (64, 4096), "float16", {"softmax": "row_norm"}, 128, 128),
    ("softmax", (2, 4, 64, 128), "float16", {"softmax": "row_norm"}, 128, 128),  # 8 rows a block
    ("softmax_scale_mask", (2, 4, 64, 64), "float32",
     {"fused_multiply_add": "elementwise", "softmax": "row_norm"}, 128, 128),
    ("elementwise", (64, 4096), "float16", {"fused_add_multiply_gelu_cast": "elementwise"}, 128, 128),
    ("elementwise", (64, 4096), "float32", {"fused_add_multiply_gelu_cast": "elementwise"}, 128, 128),
    # 4100 % 8 != 0: 4-wide vectors, 16-byte fp32 loads and 8-byte fp16 stores
    ("elementwise", (64, 4100), "float32", {"fused_add_multiply_gelu_cast": "elementwise"}, 128, 64),
]
VECTOR_TYPES = {128: r"\*\((uint4|float4)\*\)", 64: r"\*\((uint2|half4|float2)\*\)"}


@needs_nvcc
@pytest.mark.parametrize("kind, shape, dtype, rules, ld_bits, st_bits", CUDA_CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}" for c in CUDA_CASES])
def test_cuda_vector_access(kind, shape, dtype, rules, ld_bits, st_bits, tmp_path):
    lowered = pipeline.lower(graph(kind, shape, dtype), SM90)
    funcs = prim_funcs(lowered)
    assert {name: f.attrs.get(RULE_ATTR) for name, f in funcs.items()} == rules

    source = cuda_source(pipeline.build(lowered, SM90))
    for bits in {ld_bits, st_bits}:
        assert re.search(VECTOR_TYPES[bits], source), f"no {bits}-bit vector access in the source"

    sass = fatbin_sass(compile_fatbin(source, SM90, tmp_path))["sm_90a"]
    assert re.search(rf"LDG\.E\.{ld_bits}\b", sass), f"no {ld_bits}-bit global load"
    assert re.search(rf"STG\.E\.{st_bits}\b", sass), f"no {st_bits}-bit global store"
    # Every global access has the vector width (no scalar loads or stores left behind).
    loads = set(re.findall(r"LDG\.E(?:\.(\w+))?", sass))
    stores = set(re.findall(r"STG\.E(?:\.(\w+))?", sass))
    assert loads == {str(ld_bits)} and stores == {str(st_bits)}, (loads, stores)
    log = (tmp_path / "kernels.ptxas.log").read_text()
    assert set(re.findall(r"(\d+) bytes spill", log)) <= {"0"}, log
    assert all(int(r) <= 128 for r in re.findall(r"Used (\d+) registers", log)), log


@needs_nvcc
def test_layer_norm_reads_x_once(tmp_path):
    """One 16-byte load per thread and vector of x, w and b: 8192 × 4096 fp16 with 256 threads
    holds 2 vectors of each per thread, so 6 LDG.E.128 and 2 STG.E.128 in all."""
    lowered = pipeline.lower(graph("layer_norm", (8192, 4096), "float16"), SM90)
    source = cuda_source(pipeline.build(lowered, SM90))
    assert "__launch_bounds__(256)" in source
    sass = fatbin_sass(compile_fatbin(source, SM90, tmp_path))["sm_90a"]
    assert len(re.findall(r"LDG\.E\.128", sass)) == 6
    assert len(re.findall(r"STG\.E\.128", sass)) == 2
    assert len(re.findall(r"MUFU\.RSQ", sass)) == 1  # rsqrt once per row, not per element


@pytest.mark.parametrize("kind, shape, dtype, warp", [
    ("softmax", (1, 4, 16, 16), "float32", True),     # 4 lanes a row, 32 rows a block
    ("rms_norm", (37, 96), "float32", True),          # 8 lanes a row, rows predicated
    ("layer_norm", (64, 4096), "float16", False),     # 256 threads a row
])
def test_reduction_results(kind, shape, dtype, warp):
    """A row within a warp keeps its reduction results in registers (shuffles, no shared memory,
    no barrier); a row of several warps publishes them in shared memory behind a barrier."""
    lowered = pipeline.lower(graph(kind, shape, dtype), SM90)
    source = cuda_source(pipeline.build(lowered, SM90))
    body = source[source.index("__global__"):]
    assert "__shfl_down_sync" in body
    if warp:
        assert "__shared__" not in body and "__syncthreads" not in body
    else:
        assert re.search(r"_shared_ptr\[0\] = \(\(volatile float\*\)red_result_ptr\)\[0\];\s*\}\s*"
                         r"__syncthreads\(\);", body)


# ---------------------------------------------------------------------------------------------
# semantics on the CPU

SEMANTIC_CASES = [
    ("layer_norm", (16, 256), "float16"),
    ("layer_norm", (4, 3, 4100), "float32"),
    ("rms_norm", (8, 4096), "float16"),
    ("rms_norm_hf", (2, 8, 512), "float16"),
    ("softmax", (2, 4, 16, 128), "float16"),
    ("softmax", (8, 4100), "float32"),
    ("softmax", (30, 8), "float32"),
    ("rms_norm", (37, 96), "float32"),
    ("softmax_scale_mask", (2, 3, 16, 64), "float32"),
    ("elementwise", (16, 4096), "float16"),
    ("elementwise", (7, 13), "float32"),
]


def _serial(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """``func`` with every thread binding a serial loop: plain TIR that runs on the CPU."""
    text = re.sub(r'T\.thread_binding\(([^,]+), thread="[^"]+"\)', r"T.serial(\1)",
                  tvm.IRModule({"main": func}).script())
    return tvm.script.from_source(text)["main"]


def _run_llvm(func: tvm.tirx.PrimFunc, args: list[np.ndarray]) -> np.ndarray:
    lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                         target="llvm")
    tensors = [tvm.runtime.tensor(a) for a in args]
    lib(*tensors)
    return tensors[-1].numpy().astype(np.float64)


def _schedule(func: tvm.tirx.PrimFunc):
    """The first of ``gpu_rules()`` that takes ``func`` (what ``ApplyDefaultSchedule`` does), the
    elementwise rule without ``fast_erf``: its ``__expf`` / ``__fdividef`` are CUDA intrinsics the
    LLVM run cannot call (its accuracy: ``test_fast_erf_formula_accuracy`` and the GPU tests)."""
    target = SM90.tvm_target()
    rules = [Elementwise(config=dataclasses.replace(r.config, fast_erf=False))
             if isinstance(r, Elementwise) else r for r in gpu_rules()]
    with target:
        for rule in rules:
            sch = rule.apply(func, target, False)
            if sch is not None:
                return sch
    raise AssertionError("no rule took the function")


@pytest.mark.parametrize("kind, shape, dtype", SEMANTIC_CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}" for c in SEMANTIC_CASES])
def test_schedule_keeps_semantics(kind, shape, dtype):
    # Lowered for the CPU, the fused PrimFuncs are the ones the CUDA path schedules, unscheduled.
    funcs = prim_funcs(pipeline.lower(graph(kind, shape, dtype), CPU))
    rng = np.random.default_rng(0)
    rules = set()
    for func in funcs.values():
        sch = _schedule(func)
        scheduled = sch.mod["main"]
        rules.add(scheduled.attrs.get(RULE_ATTR))
        assert tvm.s_tir.analysis.verify_well_formed(sch.mod)
        # Positive inputs: a kernel's input may be a mean of squares that goes into rsqrt.
        args = [rng.uniform(0.25, 2.0, [int(d) for d in p.shape]).astype(str(p.dtype))
                for p in func.params]
        want = _run_llvm(func, args)
        got = _run_llvm(_serial(scheduled), args)
        tol = 1e-3 if dtype == "float16" else 1e-5
        assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)
    assert rules <= {"row_norm", "elementwise"} and rules


@needs_nvcc
def test_fused_scale_mask_softmax(tmp_path):
    """softmax(x · 0.125 + mask) in ONE PrimFunc (as a fusion pass that pulls the prologue into
    the softmax would leave it): x and the broadcast (S, N) mask both become register tiles
    loaded with 16-byte vectors; same results as the unscheduled function."""
    from tvm import te, topi

    x = te.placeholder((2, 3, 16, 64), "float16", name="x")
    mask = te.placeholder((16, 64), "float16", name="mask")
    s = te.compute(x.shape, lambda b, h, i, j: x[b, h, i, j] * tvm.tirx.const(0.125, "float16")
                   + mask[i, j], name="s")
    func = te.create_prim_func([x, mask, topi.nn.softmax(s, axis=-1)])
    target = SM90.tvm_target()
    with target:
        sch = RowNorm().apply(func, target, False)
    assert sch is not None and sch.mod["main"].attrs[RULE_ATTR] == "row_norm"
    rng = np.random.default_rng(0)
    args = [rng.uniform(0.25, 2.0, [int(d) for d in p.shape]).astype("float16") for p in func.params]
    want, got = _run_llvm(func, args), _run_llvm(_serial(sch.mod["main"]), args)
    assert np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want)
    kernel = sch.mod["main"].with_attr("global_symbol", "main").with_attr("target", target)
    source = tvm.tirx.build(tvm.IRModule({"main": kernel}), target=target).imports[0].inspect_source()
    sass = fatbin_sass(compile_fatbin(source, SM90, tmp_path))["sm_90a"]
    assert set(re.findall(r"LDG\.E(?:\.(\w+))?", sass)) == {"128"}  # x and mask
    assert set(re.findall(r"STG\.E(?:\.(\w+))?", sass)) == {"128"}


# ---------------------------------------------------------------------------------------------
# what the rules must leave alone


def test_gemm_and_plain_reductions_are_not_taken():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 256), "float16"))
    w = relax.Var("w", relax.TensorType((256, 512), "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.gelu(relax.op.matmul(x, w)))  # GEMM + epilogue
            s = bb.emit(relax.op.sum(y, axis=[-1]))  # a reduction with no row epilogue
            c = bb.emit(relax.op.sum(y, axis=[0]))  # over a leading axis
            out = bb.emit_output((s, c))
        bb.emit_func_output(out)
    funcs = prim_funcs(pipeline.lower(bb.get(), CPU))
    target = SM90.tvm_target()
    with target:
        for name, func in funcs.items():
            assert RowNorm().apply(func, target, False) is None, name
            assert Elementwise().apply(func, target, False) is None, name
    lowered = prim_funcs(pipeline.lower(bb.get(), SM90))
    # the GEMM goes to a GEMM rule (fp16 products accumulate in fp32 since the canonical stage);
    # no memory-bound rule takes the GEMM or the plain reductions
    rules = {name: str(f.attrs.get(RULE_ATTR)) for name, f in lowered.items() if f.attrs.get(RULE_ATTR)}
    assert all(rule.startswith("gemm") for rule in rules.values()), rules


def test_rules_decline_cpu_targets():
    func = next(iter(prim_funcs(pipeline.lower(graph("softmax", (4, 64), "float32"), CPU)).values()))
    llvm = CPU.tvm_target()
    assert RowNorm().apply(func, llvm, False) is None
    assert Elementwise().apply(func, llvm, False) is None


def test_gpu_rules_order():
    names = [type(r).__name__ for r in gpu_rules()]
    assert names[:8] == ["GemmSimtRowStats", "Gemv", "GemmSM80", "Matmul", "GuardedGEMV", "RowNorm",
                         "RowStats", "Elementwise"]
    assert names[-2:] == ["Fallback", "SingleThread"]  # what dlight's Fallback leaves: one thread


@pytest.mark.parametrize("n_vec, rows, want", [
    (512, 8192, (256, 1)),   # 4096 fp16: 256 threads, 2 vectors each
    (1024, 64, (512, 1)),    # 4096 fp32
    (1025, 64, (205, 1)),    # 4100: a divisor, not a multiple of 32
    (16, 800, (16, 8)),      # 128 fp16: a half warp per row, 8 rows per block
    (128, 256, (64, 1)),     # 512 fp32: two warps a row, so one row a block (see choose_threads)
    (2, 30, (2, 30)),        # 8 fp32: rows packed up to the row count
    (24, 100, (8, 16)),      # 3 vectors a thread on a power-of-two sub-warp
    (3, 100, None),          # odd and short: one thread a row would be no reduction at all
    (4099, 10, None),        # prime: no exact split; dlight takes it
])
def test_choose_threads(n_vec, rows, want):
    assert choose_threads(n_vec, rows) == want


# ---------------------------------------------------------------------------------------------
# elementwise variants: y = gelu(x · a + b) · c + d (tools/bench/bench_elementwise.py)


def chain_graph(shape: tuple[int, ...], dtype: str) -> tvm.IRModule:
    """``main(x, a, b, c, d) = gelu(x · a + b) · c + d``: x, d of ``shape``, a, b, c (N,)."""
    n = shape[-1]
    bb = relax.BlockBuilder()
    x, d = (relax.Var(name, relax.TensorType(shape, dtype)) for name in "xd")
    a, b, c = (relax.Var(name, relax.TensorType((n,), dtype)) for name in "abc")
    with bb.function("main", [x, a, b, c, d]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.gelu(relax.op.add(relax.op.multiply(x, a), b)))
            out = bb.emit_output(relax.op.add(relax.op.multiply(h, c), d))
        bb.emit_func_output(out)
    return bb.get()


def _chain_func(shape: tuple[int, ...], dtype: str) -> tvm.tirx.PrimFunc:
    """The chain's one fused PrimFunc, unscheduled."""
    (func,) = prim_funcs(pipeline.lower(chain_graph(shape, dtype), CPU)).values()
    return func


def _variant_kernel(name: str, func: tvm.tirx.PrimFunc):
    """``(scheduled PrimFunc, CUDA source)`` of ``func`` under elementwise variant ``name``."""
    target = SM90.tvm_target()
    with target:
        sch = Elementwise(config=ew_rule.VARIANTS[name]).apply(func, target, False)
    assert sch is not None and sch.mod["main"].attrs[RULE_ATTR] == "elementwise"
    kernel = sch.mod["main"].with_attr("global_symbol", "main").with_attr("target", target)
    mod = tvm.tirx.build(tvm.IRModule({"main": kernel}), target=target)
    return sch.mod["main"], mod.imports[0].inspect_source()


# (variant, shape, 128-bit global loads, 128-bit stores): x and d are 1 vector each per thread per
# row of k; a, b, c one vector each — or k each where the k vectors are adjacent (no row reuse).
VARIANT_CASES = [
    ("v1", (64, 4096), 5, 1),
    ("v1_occ8", (64, 4096), 5, 1),
    ("v2", (64, 4096), 10, 2),         # 2 adjacent vectors of every input
    ("v2_rows", (64, 4096), 7, 2),     # rows i, i+1: x, d twice; a, b, c once
    ("v4_rows", (2, 32, 4096), 11, 4),
    ("v4", (64, 4096), 20, 4),
    ("v2_rows_erf", (64, 4096), 7, 2),
    ("v4_rows", (6, 4096), 5, 1),      # 6 rows % 4: one vector a thread
    ("v4_rows", (64, 1024), 5, 1),     # 128 vectors a row < 256 threads: one vector a thread
    ("v2", (256, 4112), 10, 2),        # 4112 = 16 · 257: 2 adjacent vectors, 257 of a row
]


@needs_nvcc
@pytest.mark.parametrize("name, shape, n_ld, n_st", VARIANT_CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in VARIANT_CASES])
def test_elementwise_variant_sass(name, shape, n_ld, n_st, tmp_path):
    """Every global access is a 16-byte vector; the loads in flight per thread are the variant's
    (counted in the SASS); no spills; ``min_blocks_per_sm`` caps registers via launch bounds."""
    config = ew_rule.VARIANTS[name]
    _, source = _variant_kernel(name, _chain_func(shape, "float16"))
    bounds = re.findall(r"__launch_bounds__\(([^)]*)\)", source)
    want = f"256, {config.min_blocks_per_sm}" if config.min_blocks_per_sm else "256"
    assert bounds and set(bounds) == {want}, bounds
    assert ("__fdividef" in source) == config.fast_erf and ("erff" in source) != config.fast_erf
    sass = fatbin_sass(compile_fatbin(source, SM90, tmp_path))["sm_90a"]
    loads = re.findall(r"LDG\.E(?:\.(\w+))?", sass)
    stores = re.findall(r"STG\.E(?:\.(\w+))?", sass)
    assert set(loads) == {"128"} and set(stores) == {"128"}, (loads, stores)
    assert (len(loads), len(stores)) == (n_ld, n_st)
    log = (tmp_path / "kernels.ptxas.log").read_text()
    assert set(re.findall(r"(\d+) bytes spill", log)) <= {"0"}, log
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    if config.min_blocks_per_sm:
        assert regs and max(regs) <= 65536 // (256 * config.min_blocks_per_sm), log


SEMANTIC_VARIANTS = [name for name, cfg in ew_rule.VARIANTS.items() if not cfg.fast_erf]


@pytest.mark.parametrize("shape", [(8, 4096), (6, 2048), (3, 5, 40)])
@pytest.mark.parametrize("name", SEMANTIC_VARIANTS)
def test_elementwise_variant_semantics(name, shape):
    """Every variant (thread bindings as serial loops, on the CPU) computes what the unscheduled
    chain computes, bit for bit: the schedules only move loads and stores."""
    func = _chain_func(shape, "float16")
    scheduled, _ = _variant_kernel(name, func)
    assert tvm.s_tir.analysis.verify_well_formed(tvm.IRModule({"main": scheduled}))
    rng = np.random.default_rng(1)
    args = [rng.standard_normal([int(d) for d in p.shape]).astype("float16") for p in func.params]
    np.testing.assert_array_equal(_run_llvm(_serial(scheduled), args), _run_llvm(func, args))


@pytest.mark.parametrize("shape, threads", [
    ((3, 5, 40), 75),      # 75 vectors: one block of 75 threads
    ((64, 4112), 128),     # 64 · 514 = 128 · 257 vectors: 128 threads divide them, 256 do not
    ((1, 8, 13 * 8), 104),  # 104 vectors
])
def test_elementwise_blocks_are_whole(shape, threads):
    """The vectorised schedule never has a partial last block: its local → global copy (from
    ``reverse_compute_at``) has no predicate, so threads past the end would store out of bounds.
    blockIdx.x · threadIdx.x · 8 (fp16 lanes) = the elements, and the chosen thread count."""
    scheduled, _ = _variant_kernel("v1", _chain_func(shape, "float16"))
    text = scheduled.script()
    extents = {tag: int(n) for n, tag in re.findall(
        r'T\.thread_binding\((?:T\.int64\()?(\d+)\)?, thread="(\w+\.x)"\)', text)}
    assert extents["threadIdx.x"] == threads, extents
    assert extents["blockIdx.x"] * threads * 8 == int(np.prod(shape)), extents


BROADCAST_CASES = [((2, 7, 4096), (7, 4096)), ((4, 6, 4096), (6, 4096)),
                   ((4, 6, 4096), (4, 1, 4096)), ((4, 6, 4096), (4096,)), ((4, 6, 4096), (4, 6, 4096))]


@pytest.mark.parametrize("name", ["v2_rows", "v4_rows"])
@pytest.mark.parametrize("shape, mshape", BROADCAST_CASES,
                         ids=[f"{'x'.join(map(str, s))}+{'x'.join(map(str, m))}"
                              for s, m in BROADCAST_CASES])
def test_elementwise_rows_with_broadcasts(name, shape, mshape):
    """``x + m`` with m broadcast over leading dims: the k-row variants build for CUDA (the k rows
    split only the last row dim, so every cached region is a constant size; split across a fused
    (b, s) loop, the build failed with "Cannot unroll non-constant loop") and keep the semantics."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float16"))
    m = relax.Var("m", relax.TensorType(mshape, "float16"))
    with bb.function("main", [x, m]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(x, m))
        bb.emit_func_output(out)
    (func,) = prim_funcs(pipeline.lower(bb.get(), CPU)).values()
    scheduled, source = _variant_kernel(name, func)
    assert "uint4" in source
    rng = np.random.default_rng(2)
    args = [rng.standard_normal([int(d) for d in p.shape]).astype("float16") for p in func.params]
    np.testing.assert_array_equal(_run_llvm(_serial(scheduled), args), _run_llvm(func, args))


def test_fast_erf_formula_accuracy():
    """The A&S 7.1.26 erf of ``fast_erf`` in float32 arithmetic: |erf − exact| ≤ 1e-6 on [−6, 6]
    (the device's ``__expf`` / ``__fdividef`` are checked against torch by the GPU run)."""
    from math import erf

    from tvmfuse.kernels.gemm.opmath import _AS_A, _AS_P

    x = np.linspace(-6, 6, 200001, dtype=np.float32)
    f = np.float32
    t = f(1) / (f(1) + f(_AS_P) * np.abs(x))
    poly = f(_AS_A[4])
    for a in reversed(_AS_A[:4]):
        poly = f(a) + t * poly
    y = f(1) - t * poly * np.exp(-(x * x))
    y = np.where(x < 0, -y, y).astype(np.float64)
    exact = np.array([erf(float(v)) for v in x])
    assert np.abs(y - exact).max() <= 1e-6


def test_default_variant_is_named():
    assert Options().elementwise_variant in ew_rule.VARIANTS
    assert Elementwise().config == ew_rule.VARIANTS[Options().elementwise_variant]
    with use_options(Options(elementwise_variant="v1")):
        assert Elementwise().config == ew_rule.VARIANTS["v1"]
    assert Elementwise(threads=128).config.threads == 128


# ---------------------------------------------------------------------------------------------
# gathers as vectors (ElementwiseConfig.vector_gathers)


def rope_pack_graph(seq: int, heads: int, kv_heads: int, dim: int, shift: int = 0) -> tvm.IRModule:
    """An LLM prefill's q / k / v out of one QKV GEMM output, RoPE'd by rotate-half and packed
    into one flat buffer: ``concat(rot(q), rot(k), v)`` — the kernel before the attention.
    ``shift`` > 0 starts every slice ``shift`` columns later (then no vector is aligned)."""
    width = (heads + 2 * kv_heads) * dim + shift
    bb = relax.BlockBuilder()
    qkv = relax.Var("qkv", relax.TensorType((seq, width), "float16"))
    cos = relax.Var("cos", relax.TensorType((seq, dim), "float16"))
    sin = relax.Var("sin", relax.TensorType((seq, dim), "float16"))
    op = relax.op

    def piece(start: int, n: int):
        return op.reshape(op.strided_slice(qkv, [1], [start + shift], [start + shift + n * dim]),
                          (seq, n, dim))

    def rot(x):
        halves = bb.emit(op.split(x, 2, axis=-1))
        lo, hi = relax.TupleGetItem(halves, 0), relax.TupleGetItem(halves, 1)
        half = op.concat([op.negative(hi), lo], axis=-1)
        c, s = op.reshape(cos, (seq, 1, dim)), op.reshape(sin, (seq, 1, dim))
        return op.add(op.multiply(x, c), op.multiply(half, s))

    with bb.function("main", [qkv, cos, sin]):
        with bb.dataflow():
            q = bb.emit(rot(bb.emit(piece(0, heads))))
            k = bb.emit(rot(bb.emit(piece(heads * dim, kv_heads))))
            v = bb.emit(piece((heads + kv_heads) * dim, kv_heads))
            out = bb.emit_output(op.concat([op.reshape(t, (-1,)) for t in (q, k, v)], axis=0))
        bb.emit_func_output(out)
    return bb.get()


def _pack_kernel(shift: int = 0, gathers: bool = True):
    """``(unscheduled PrimFunc, scheduled PrimFunc, CUDA source)`` of the RoPE pack kernel."""
    (func,) = prim_funcs(pipeline.lower(rope_pack_graph(64, 4, 2, 128, shift), CPU)).values()
    target = SM90.tvm_target()
    config = dataclasses.replace(ew_rule.VARIANTS["v2_rows"], vector_gathers=gathers)
    with target:
        sch = Elementwise(config=config).apply(func, target, False)
    assert sch is not None and sch.mod["main"].attrs[RULE_ATTR] == "elementwise"
    kernel = sch.mod["main"].with_attr("global_symbol", "main").with_attr("target", target)
    source = tvm.tirx.build(tvm.IRModule({"main": kernel}), target=target).imports[0].inspect_source()
    return func, sch.mod["main"], source


@pytest.mark.parametrize("shift, gathers", [(0, True), (0, False), (3, True)])
def test_gathers_keep_semantics(shift, gathers):
    """The pack kernel computes, with its thread bindings as serial loops on the CPU, what the
    unscheduled function computes, bit for bit: vectors (aligned), per-element loads (the option
    off) and the unaligned slices that stay per element alike."""
    func, scheduled, _ = _pack_kernel(shift, gathers)
    assert tvm.s_tir.analysis.verify_well_formed(tvm.IRModule({"main": scheduled}))
    rng = np.random.default_rng(3)
    args = [rng.standard_normal([int(d) for d in p.shape]).astype("float16") for p in func.params]
    np.testing.assert_array_equal(_run_llvm(_serial(scheduled), args), _run_llvm(func, args))


@needs_nvcc
@pytest.mark.parametrize("shift, gathers, want", [
    (0, True, {"128"}),   # q, k, their rotate-half partners, v, cos, sin: 11 16-byte loads
    (0, False, {"U16"}),  # the option off: one 2-byte load per element (88)
    (3, True, {"U16"}),   # slices 3 columns in: no vector is aligned, per element
])
def test_gathers_become_vector_loads(shift, gathers, want, tmp_path):
    """RoPE + pack, as every LLM prefill has it (``rope_pack_graph``): the conditions of the
    concatenations and of the rotate-half are the same for a vector's 8 lanes, so each of its
    loads is one aligned ``LDG.E.128``; the stores stay 16-byte; no spills."""
    _, scheduled, source = _pack_kernel(shift, gathers)
    # the compute loop is vectorised besides the store's copy exactly where the loads are vectors
    assert scheduled.script().count("T.vectorized") == (2 if want == {"128"} else 1)
    sass = fatbin_sass(compile_fatbin(source, SM90, tmp_path))["sm_90a"]
    loads = set(re.findall(r"LDG\.E(?:\.(\w+))?", sass))
    stores = set(re.findall(r"STG\.E(?:\.(\w+))?", sass))
    assert stores == {"128"}, stores
    assert loads == want, loads
    log = (tmp_path / "kernels.ptxas.log").read_text()
    assert set(re.findall(r"(\d+) bytes spill", log)) <= {"0"}, log


@needs_nvcc
def test_gather_under_a_loaded_condition_builds(tmp_path):
    """``where(kept[r], y[r, N + j], 0)`` (transformers' MoE rows: a slice of the all-experts GEMM
    output under a bool row mask): the condition is the same for a vector's lanes but loads a
    bool buffer. Vectorised, TVM's CUDA codegen declared it ``half4 c = make_ushort4(...)`` and
    nvcc refused the kernel; the rule keeps such a kernel per element (semantics unchanged)."""
    bb = relax.BlockBuilder()
    y = relax.Var("y", relax.TensorType((64, 256), "float16"))
    kept = relax.Var("kept", relax.TensorType((64, 1), "bool"))
    with bb.function("main", [y, kept]):
        with bb.dataflow():
            part = relax.op.strided_slice(y, [1], [128], [256])
            out = bb.emit_output(relax.op.where(kept, part, relax.const(0, "float16")))
        bb.emit_func_output(out)
    (func,) = prim_funcs(pipeline.lower(bb.get(), CPU)).values()
    target = SM90.tvm_target()
    with target:
        sch = Elementwise(config=ew_rule.VARIANTS["v2_rows"]).apply(func, target, False)
    kernel = sch.mod["main"].with_attr("global_symbol", "main").with_attr("target", target)
    source = tvm.tirx.build(tvm.IRModule({"main": kernel}), target=target).imports[0].inspect_source()
    assert "make_ushort4" not in source
    compile_fatbin(source, SM90, tmp_path)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((64, 256)).astype("float16"), rng.random((64, 1)) < 0.5,
            np.zeros((), "float16"), np.ones((64, 128), "float16")]  # where()'s 0; the output
    np.testing.assert_array_equal(_run_llvm(_serial(sch.mod["main"]), args), _run_llvm(func, args))


def test_gathers_option():
    assert Elementwise().config.vector_gathers
    with use_options(Options(elementwise_vector_gathers=False)):
        assert not Elementwise().config.vector_gathers


@pytest.mark.parametrize("shift, gathers", [(0, True), (0, False), (3, True)])
def test_torch_rope_pack_gathers(shift, gathers):
    """The pack written as a torch module (``test_gpu_memory_bound.RopePack``) is one elementwise
    kernel whose qkv, cos and sin loads are 16-byte vectors when its slices are aligned and the
    option is on, and per element otherwise (its GPU numerics: ``test_rope_pack_gathers``)."""
    pytest.importorskip("torch")
    import tvmfuse
    from tests.test_gpu_memory_bound import rope_pack_case

    module, example = rope_pack_case(shift)
    lib = tvmfuse.compile(module, example, target="sm90",
                          options=Options(elementwise_vector_gathers=gathers))
    source = cuda_source(lib.executable)
    assert len(set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))) == 1
    vectors = set(re.findall(r"\*\(uint4\*\)\((\w+) \+", source))
    assert ({"qkv_ptr", "cos_ptr", "sin_ptr"} <= vectors) == (gathers and shift == 0), vectors


# ---------------------------------------------------------------------------------------------
# a norm reading a slice of a wider tensor (passes/norm_input_copies.py, row_norm inline_copies)


@pytest.mark.parametrize("start, vectors", [(16, True), (3, False)])
def test_norm_of_a_slice(start, vectors, tmp_path):
    """Qwen3's per-head norm of the QKV output's q columns, fused with its slice and reshape:
    the rule inlines the copies and reads ``x[s, start + h·D + d]`` itself — as 16-byte vectors
    into a register tile where each row's start is a multiple of 8 halves, else per element —
    and computes what the unscheduled function does, bit for bit (thread bindings as loops)."""
    from tests.test_pass_norm_input_copies import qk_norm_module
    from tvmfuse.passes.norm_input_copies import NormInputCopies

    mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(NormInputCopies()(
        qk_norm_module(start=start, width=4 * 16 + 8))))
    func = mod["fused_strided_slice_reshape_rms_norm"]
    sch = _schedule(func)
    scheduled = sch.mod["main"]
    assert scheduled.attrs[RULE_ATTR] == "row_norm"
    rng = np.random.default_rng(4)
    args = [rng.standard_normal([int(d) for d in p.shape]).astype("float16") for p in func.params]
    np.testing.assert_array_equal(_run_llvm(_serial(scheduled), args), _run_llvm(func, args))
    target = SM90.tvm_target()
    kernel = scheduled.with_attr("global_symbol", "main").with_attr("target", target)
    source = tvm.tirx.build(tvm.IRModule({"main": kernel}), target=target).imports[0].inspect_source()
    loaded = set(re.findall(r"\*\(uint4\*\)\((\w+) \+", source))
    assert ("x_ptr" in loaded) == vectors, loaded
