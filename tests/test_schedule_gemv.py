"""Weight-streaming GEMV / small-M GEMM (kernels/gemm/gemv.py, rules/gemv.py).

CPU: which GEMMs the rule and the ``gemv`` stage take (M ≤ 64, a weight operand, sm_80+), the LM's
decode graph on sm90 / sm80, and nvcc builds for sm_80 / sm_90a whose SASS streams W with
``LDG.E.128`` (and uses ``HMMA`` for the tensor-core engine) without spills.
GPU (``-m gpu``): numerics against torch for M in (1, 4, 16, 64) with each epilogue; the ring
engine (a cp.async ring of W in shared memory) against float64 numpy.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import tvm
from tvm import te, tirx

from tests.cuda_tools import kernel_bodies, needs_nvcc
from tvmfuse.attrs import RULE_ATTR
from tvmfuse.build.inspect import cuda_source, fatbin_sass
from tvmfuse.build.nvcc import compile_fatbin
from tvmfuse.frontend import import_model, input_overrides
from tvmfuse.kernels.gemm.gemv import GemvConfig, GemvProblem, check, pick_config, standalone
from tvmfuse.options import Options, use_options
from tvmfuse.rules import Gemv
from tvmfuse.targets import get_target
from tvmfuse.tvm_setup import codegen_scope

SM80, SM90 = get_target("sm80"), get_target("sm90")
GEMV_OFF = Options(small_m_gemv=False)
GEMV_ALL = Options(gemv_max_m=64)  # the default takes M ≤ 8; these tests cover the mma engine too


@pytest.fixture(autouse=True)
def _gemv_on(request):
    """Every test here runs with the kernel on up to M = 64, except those marked ``gemv_off``."""
    with use_options(GEMV_OFF if "gemv_off" in request.keywords else GEMV_ALL):
        yield


def te_linear(m: int, n: int, k: int, kn: bool = False, dtype: str = "float16") -> tirx.PrimFunc:
    """TE ``cast(x · Wᵀ + b)`` with W (N, K) (or (K, N) when ``kn``)."""
    x = te.placeholder((m, k), dtype, name="x")
    w = te.placeholder((k, n) if kn else (n, k), dtype, name="w")
    b = te.placeholder((n,), dtype, name="b")
    r = te.reduce_axis((0, k), name="k")
    mm = te.compute((m, n), lambda i, j: te.sum(
        x[i, r].astype("float32") * (w[r, j] if kn else w[j, r]).astype("float32"), axis=r),
        name="matmul")
    y = te.compute((m, n), lambda i, j: (mm[i, j] + b[j].astype("float32")).astype(dtype), name="y")
    return te.create_prim_func([x, w, b, y])


@pytest.mark.parametrize("m", [1, 8, 16, 64])
def test_rule_takes_small_m(m):
    sch = Gemv().apply(te_linear(m, 256, 512), SM80.tvm_target(), False)
    assert sch is not None and sch.mod["main"].attrs[RULE_ATTR] == "gemv"


@pytest.mark.parametrize("func, target", [
    (te_linear(65, 256, 512), SM80),  # M > 64: a GEMM for the tensor-core rules
    (te_linear(1, 256, 512, kn=True), SM80),  # (K, N) weight: only the pass can transpose it
    (te_linear(1, 256, 516), SM80),  # K not a multiple of 8
    (te_linear(1, 256, 512, dtype="float32"), SM80),  # fp32
    (te_linear(1, 256, 512), get_target("cpu")),
], ids=["m65", "kn", "k516", "fp32", "cpu"])
def test_rule_returns_none(func, target):
    assert Gemv().apply(func, target.tvm_target(), False) is None


def test_not_a_gemm():
    x = te.placeholder((4, 64), "float16", name="x")
    y = te.compute((4, 64), lambda i, j: x[i, j] * 2, name="y")
    assert Gemv().apply(te.create_prim_func([x, y]), SM80.tvm_target(), False) is None


def test_check_and_pick_config():
    p = GemvProblem(16, 4096, 4096, "float16", "float16")
    assert check(p, GemvConfig()) is not None  # M = 16 on CUDA cores
    assert pick_config(p, 132).mma
    assert not pick_config(GemvProblem(4, 4096, 4096, "float16", "float16"), 132).mma
    eight = GemvProblem(8, 4096, 4096, "float16", "float16")
    assert pick_config(eight, 132).mma  # measured faster from M = 8 (pick_config's docstring)
    # the mma engine's measured configs: up to M = 8 8 rows, 16 warps, 4 chunks in flight, with
    # or without the norm statistics (bench_gemv --ms 8, session 30); above, 8 warps, 4 chunks
    # (2 above M = 16)
    sixteen_warps = GemvConfig(rows=8, warps=16, unroll=4, mma=True)
    qkv = GemvProblem(8, 12288, 4096, "float16", "float16")
    for problem in (eight, qkv, GemvProblem(5, 22016, 4096, "float16", "float16", pair=True)):
        assert pick_config(problem, 132) == sixteen_warps
        assert pick_config(problem, 132, row_stats=True) == sixteen_warps
    assert pick_config(p, 132) == GemvConfig(rows=8, warps=8, unroll=4, mma=True)
    assert pick_config(GemvProblem(64, 4096, 4096, "float16", "float16"), 132) == GemvConfig(
        rows=8, warps=8, unroll=2, mma=True)
    # above M = 8 with the norm statistics in the loop every block recomputes them: 32-row blocks
    # where N gives every SM one, else the 8-row config (bench_gemv --stats, session 15)
    assert pick_config(p, 132, row_stats=True) == GemvConfig(rows=8, warps=8, unroll=4, mma=True)
    qkv16 = GemvProblem(16, 12288, 4096, "float16", "float16")
    assert pick_config(qkv16, 132, row_stats=True) == GemvConfig(rows=32, warps=4, unroll=2,
                                                                 mma=True)
    assert not pick_config(eight, 132, simt_max_m=8).mma
    assert pick_config(GemvProblem(1, 4096, 4096, "float16", "float16"), 132, simt_max_m=0).mma
    small_n = pick_config(GemvProblem(1, 256, 4096, "float16", "float16"), 132)
    assert -(-256 // small_n.rows) >= 132  # small N: fewer rows a block, every SM streams
    assert check(GemvProblem(1, 255, 4096, "float16", "float16", pair=True), GemvConfig(rows=2))


def _lm_rules(target) -> list[str | None]:
    """The rule of each GEMM kernel launch of models/llama_lm.py's small LM at one token."""
    from tvmfuse.report import analyze

    imported = import_model("models.llama_lm:small", None, input_overrides(["ids:1x1"]))
    report = analyze(imported.mod, target, None, stock=False)
    return [k.get("rule") for k in report["kernels"] if "matmul" in k["ops"]]


@pytest.mark.parametrize("target", [SM90, SM80], ids=["sm90", "sm80"])
def test_lm_decode_gemms_stream(target):
    """QKV (+ RMSNorm stats), O + residual, gate/up pair (+ stats), down + residual, lm_head: all
    gemv kernels, the statistics and the SiLU·mul inside them (no separate kernels)."""
    rules = _lm_rules(target)
    assert set(rules) == {"gemv"}, rules
    assert len(rules) == 2 * 4 + 1, rules  # 2 layers × 4 GEMMs + lm_head


@pytest.mark.gemv_off
@pytest.mark.parametrize("target", [SM90, SM80], ids=["sm90", "sm80"])
def test_off_with_the_option(target):
    """With ``Options(small_m_gemv=False)`` no kernel is a gemv one and the rule declines."""
    assert "gemv" not in _lm_rules(target)
    assert Gemv().apply(te_linear(1, 256, 512), SM80.tvm_target(), False) is None


@pytest.mark.slow
@pytest.mark.parametrize("on, fold", [(False, False), (True, False), (True, True)],
                         ids=["default", "prefetch_after_attention", "with_the_folded_append"])
def test_prefetch_after_attention_takes_the_o_projection_only(on, fold):
    """``Options.gemv_prefetch_after_attention``: in compile_lm's sm90 decode the GEMV reading the
    attention's output (O projection + residual) bulk-prefetches its rows into L2 before its PDL
    wait, also when the attention does the append (its output then the second of a pair); the
    QKV, gate/up, down and lm_head GEMVs do not (nor any GEMV by default)."""
    import dataclasses

    import tvmfuse
    from tvmfuse.options import current_options

    pytest.importorskip("transformers")
    from tests.lm_reference import tiny_llama

    model = tiny_llama().half()
    opts = dataclasses.replace(current_options(), gemv_prefetch_after_attention=on,
                               decode_fold_append=fold)
    with use_options(opts):
        lib = tvmfuse.compile_lm(model, target="sm90", max_seq_len=64, prefill_lengths=[16])
    bodies = {n: body for n, (_, body) in kernel_bodies(cuda_source(lib.executable)).items()
              if n.endswith("_gemv_kernel")}
    assert len(bodies) >= 5, sorted(bodies)  # decode's five (and the prefill's small ones)
    prefetching = {n for n, body in bodies.items() if "prefetch" in body}
    # the decode O projection (hidden → hidden + the residual; the first matmul after QKV's);
    # the prefill's (flash attention before it, no PDL) does not prefetch
    assert prefetching == ({n for n in bodies if "add" in n and "matmul1" in n} if on else set()), (
        sorted(bodies), prefetching)
    # Options.gemv_preload_weights (default): the decode step's GEMVs load W before their wait,
    # the prefill's (not launched programmatically) have no wait at all
    preloading = {n for n, body in bodies.items() if "griddepcontrol_wait()" in body
                  and not body.lstrip().startswith("tvm_builtin_ptx_griddepcontrol_wait();")}
    waiting = {n for n, body in bodies.items() if "griddepcontrol_wait()" in body}
    assert len(preloading) >= 4 and preloading == waiting, (sorted(bodies), preloading, waiting)
    assert len(bodies) > len(preloading), sorted(bodies)  # the prefill's


PRELOAD_CASES = [  # (m, n, k, pair, stats): the 4-layer LM's decode shapes, K past a chunk, mma
    (1, 3072, 2048, False, True), (1, 11264, 2048, True, True), (1, 2048, 5632, False, False),
    (3, 1000, 1000, False, False), (8, 4096, 4096, False, False), (8, 12288, 4096, False, True),
    (5, 22016, 4096, True, True)]
PRELOAD_IDS = [f"{m}x{n}x{k}{'-pair' if pr else ''}{'-stats' if st else ''}"
               for m, n, k, pr, st in PRELOAD_CASES]


def _preload_source(m: int, n: int, k: int, pair: bool, stats: bool, preload: bool) -> str:
    p = GemvProblem(m, n, k, "float16", "float16", pair)
    func = standalone(p, pick_config(p, 132, row_stats=stats), rms_eps=1e-5 if stats else None,
                      preload=preload)
    with codegen_scope():
        return cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=SM90.tvm_target()))


@pytest.mark.parametrize("m, n, k, pair, stats", PRELOAD_CASES, ids=PRELOAD_IDS)
def test_preload_reads_only_weights_before_the_wait(m, n, k, pair, stats):
    """``preload``: the kernel's first statements load W (16-byte vectors into the loop's
    registers) and then wait for the predecessor; x, the statistics and y are touched only after
    the wait. Without it the kernel has no wait of its own (the PDL device pass adds one first)."""
    body = kernel_bodies(_preload_source(m, n, k, pair, stats, True))["main_kernel"][1]
    before, sep, after = body.partition("griddepcontrol_wait()")
    assert sep, "no griddepcontrol.wait"
    assert "launch_dependents" in after.split(";", 2)[1], "launch_dependents not right after it"
    assert re.search(r"\*\(uint4\*\)\(bv_ptr \+ \d+\) = \*\(uint4\*\)\(w_ptr", before)
    code = "\n".join(line for line in before.splitlines()
                     if not line.strip().startswith(("alignas", "__shared__")))  # declarations
    for name in ("x_ptr", "y_ptr", "st_ptr", "red_ptr", "acc_ptr"):
        assert name not in code, f"{name} touched before the wait"
    p = GemvProblem(m, n, k, "float16", "float16", pair)
    cfg = pick_config(p, 132, row_stats=stats)
    iters = math.ceil(math.ceil(k / cfg.chunk) / (cfg.warps * cfg.unroll))
    # later iterations still load their W in the loop (one iteration: all W came before the wait)
    assert ("w_ptr" in after) == (iters > 1), iters
    plain = kernel_bodies(_preload_source(m, n, k, pair, stats, False))["main_kernel"][1]
    assert "griddepcontrol" not in plain


def test_preload_follows_the_option_where_kernels_launch_programmatically():
    """The gemv stage builds the preloading kernel with ``Options.gemv_preload_weights`` (the
    default) for GEMVs whose kernels launch programmatically: every kernel with the scope "all";
    not in a plain model under the default scope "decode" (compile_lm's decode step only), not
    with the option off, and not on sm_80."""
    import tvmfuse

    module = torch.nn.Linear(512, 256).half()

    def preloads(target, **fields) -> bool:
        """W loads come before the kernel's wait (with PDL on every kernel waits; without the
        preload the wait is its first statement)."""
        lib = tvmfuse.compile(module, (torch.randn(1, 512).half(),), target=target.name,
                              options=Options(gemv_max_m=64, **fields))
        bodies = [b for n, (_, b) in kernel_bodies(cuda_source(lib.executable)).items()
                  if n.endswith("gemv_kernel")]
        assert len(bodies) == 1, bodies
        body = bodies[0]
        return "griddepcontrol_wait()" in body and not body.lstrip().startswith(
            "tvm_builtin_ptx_griddepcontrol_wait();")

    pdl = {"programmatic_launch": "all"}
    assert preloads(SM90, **pdl)
    assert not preloads(SM90)  # scope "decode": this model has no decode step
    assert not preloads(SM90, gemv_preload_weights=False, **pdl)
    assert not preloads(SM90, programmatic_launch="off")
    assert not preloads(SM80, **pdl)


@pytest.mark.parametrize("constant", [True, False], ids=["constant_weight", "weight_parameter"])
def test_preload_only_of_constant_weights(constant):
    """In a decode step, a GEMV preloads its (N, K) operand only when it is a constant: any other
    tensor may be written by an earlier kernel of the step, and read before the wait it could be
    stale. (The gemv stage on a hand-built ``decode`` function calling a TE Linear.)"""
    import numpy as np
    from tvm import relax

    from tvmfuse.rules.gemv import SmallMGemm

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 512), "float16"))
    w_param = relax.Var("w", relax.TensorType((256, 512), "float16"))
    w = relax.const(np.random.default_rng(0).standard_normal((256, 512)).astype("float16")) \
        if constant else w_param
    b = relax.const(np.ones(256, "float16"))
    params = [x] if constant else [x, w_param]
    with bb.function("decode", params):
        gv = bb.add_func(te_linear(1, 256, 512), "linear")
        out = bb.emit(relax.call_tir(gv, [x, w, b], relax.TensorType((1, 256), "float16")))
        bb.emit_func_output(out)
    with SM90.tvm_target(), use_options(Options(gemv_max_m=64)):
        mod = SmallMGemm(bb.get())
    (kernel,) = [f for g, f in mod.functions_items() if g.name_hint.endswith("_gemv")]
    assert ("griddepcontrol" in kernel.script()) == constant


@needs_nvcc
@pytest.mark.parametrize("m, n, k, pair, stats", PRELOAD_CASES[:2] + PRELOAD_CASES[4:],
                         ids=PRELOAD_IDS[:2] + PRELOAD_IDS[4:])
def test_preload_sass_keeps_the_registers(m, n, k, pair, stats, tmp_path):
    """The preloaded vectors live across the wait in registers: no local memory, no spills."""
    p = GemvProblem(m, n, k, "float16", "float16", pair)
    func = standalone(p, pick_config(p, 132, row_stats=stats), rms_eps=1e-5 if stats else None,
                      preload=True)
    sass, log = _sass(func, SM90, tmp_path)
    for arch, text in sass.items():
        if arch.startswith("sm_"):
            assert "LDG.E.128" in text and "STL" not in text and "LDL" not in text, arch
    assert all(s == "0" for s in re.findall(r"(\d+) bytes spill stores", log)), log


def _sass(func: tirx.PrimFunc, spec, tmp_path) -> tuple[str, str]:
    with codegen_scope():
        source = cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=spec.tvm_target()))
    sass = fatbin_sass(compile_fatbin(source, spec, tmp_path))
    return sass, (tmp_path / "kernels.ptxas.log").read_text()


@needs_nvcc
@pytest.mark.parametrize("m, n, k, pair, stats", [
    (1, 4096, 4096, False, False), (4, 688, 128, True, False), (16, 4096, 4096, False, False),
    (64, 4096, 11008, False, False), (8, 12288, 4096, False, True), (8, 22016, 4096, True, True),
    (1, 4096, 4096, False, True)])
def test_sass(m, n, k, pair, stats, tmp_path):
    """16-byte W loads, tensor cores exactly on the mma engine, no local memory — also with the
    RMS statistics in the loop (the decode's QKV and gate/up at batch 8 and 1)."""
    p = GemvProblem(m, n, k, "float16", "float16", pair)
    cfg = pick_config(p, 132, row_stats=stats)
    for spec in (SM80, SM90):
        sass, log = _sass(standalone(p, cfg, rms_eps=1e-5 if stats else None), spec, tmp_path)
        for arch, text in sass.items():
            if not arch.startswith("sm_"):
                continue
            assert "LDG.E.128" in text, f"{arch}: W not read in 16-byte vectors"
            assert ("HMMA" in text) == cfg.mma, arch
            assert "STL" not in text and "LDL" not in text, f"{arch}: local memory"
        assert all(s == "0" for s in re.findall(r"(\d+) bytes spill stores", log)), log


RING_CASES = [  # (m, n, k, pair, stats, config): N, K past the tiles and chunks; odd M
    (8, 12288, 4096, False, False, GemvConfig(16, 4, 8, True, 3)),
    (1, 1000, 1000, False, True, GemvConfig(16, 4, 8, True, 3)),
    (3, 4096, 11008, False, True, GemvConfig(32, 4, 4, True, 3)),
    (16, 688, 1032, True, False, GemvConfig(16, 4, 4, True, 2)),
    (8, 22016, 4096, True, True, GemvConfig(16, 2, 8, True, 4)),
    (64, 256, 512, False, False, GemvConfig(32, 4, 2, True, 2)),
]
RING_IDS = [f"{m}x{n}x{k}{'-pair' if pr else ''}{'-stats' if st else ''}-{c.tag.replace(' ', '_')}"
            for m, n, k, pr, st, c in RING_CASES]


def test_pick_config_takes_the_ring_for_long_k_without_statistics():
    """M = 8 on K = 11008 (the 7B's down projection at batch 8): the ring; with statistics, on
    K = 4096 or at M = 16: the register engines."""
    down = GemvProblem(8, 4096, 11008, "float16", "float16")
    assert pick_config(down, 132) == GemvConfig(16, 4, 8, True, 2)
    assert not pick_config(down, 132, row_stats=True).stages
    assert not pick_config(GemvProblem(8, 4096, 4096, "float16", "float16"), 132).stages
    assert not pick_config(GemvProblem(16, 4096, 11008, "float16", "float16"), 132).stages
    assert not pick_config(GemvProblem(1, 4096, 11008, "float16", "float16"), 132).mma


def test_ring_config_checks():
    """The ring takes 16-row tiles, even unrolls (64-wide chunks: the skew's bank argument) and
    ≥ 2 stages; its shared memory is the ring's (the reduction reuses it)."""
    p = GemvProblem(8, 4096, 4096, "float16", "float16")
    assert check(p, GemvConfig(16, 4, 8, True, 3)) is None
    assert "16-row" in check(p, GemvConfig(8, 4, 8, True, 3))
    assert "16-row" in check(p, GemvConfig(16, 4, 3, True, 3))
    assert "16-row" in check(p, GemvConfig(16, 4, 8, True, 1))
    assert "shared memory" in check(p, GemvConfig(32, 8, 8, True, 4))
    assert GemvConfig(16, 4, 8, True, 3).chunk == 256
    assert GemvConfig(16, 4, 8, True, 3).tag == "ring rows=16 warps=4 u=8 s=3"


@needs_nvcc
@pytest.mark.parametrize("m, n, k, pair, stats, cfg", RING_CASES[:3], ids=RING_IDS[:3])
def test_ring_sass(m, n, k, pair, stats, cfg, tmp_path):
    """The ring engine: W by ``LDGSTS`` (cp.async) into shared memory, fragments by 16-byte
    ``LDS.128``, ``HMMA``; x by ``LDG.E.128``; no local memory or spills on sm_80 and sm_90a."""
    p = GemvProblem(m, n, k, "float16", "float16", pair)
    for spec in (SM80, SM90):
        sass, log = _sass(standalone(p, cfg, rms_eps=1e-5 if stats else None), spec, tmp_path)
        for arch, text in sass.items():
            if not arch.startswith("sm_"):
                continue
            for op in ("LDGSTS", "LDS.128", "HMMA", "LDG.E.128"):
                assert op in text, f"{arch}: no {op}"
            assert "STL" not in text and "LDL" not in text, f"{arch}: local memory"
        assert all(s == "0" for s in re.findall(r"(\d+) bytes spill stores", log)), log


_ELEM_BYTES = {"half": 2, "nv_bfloat16": 2, "float": 4, "uint4": 16, "uint2": 8, "uint1": 4}


@pytest.mark.parametrize("m, n, k", [(16, 4096, 4096), (64, 1000, 1024), (32, 688, 128)])
def test_mma_operands_stay_inside_their_arrays(m, n, k):
    """Every ``mma.sync`` operand ``((unsigned *)(buf + off))[i]`` reads inside ``buf``'s
    declaration. Session 7's kernel passed W's registers by pointer into an array TVM retyped as
    ``uint4[]``, so the offsets (counted in halves) landed 8× too far: NaN on the H200."""
    cfg = pick_config(GemvProblem(m, n, k, "float16", "float16"), 132)
    assert cfg.mma
    with codegen_scope():
        source = cuda_source(tvm.compile(tvm.IRModule({"main": standalone(
            GemvProblem(m, n, k, "float16", "float16"), cfg)}), target=SM90.tvm_target()))
    arrays = {name: (ctype, int(size)) for ctype, name, size in
              re.findall(r"alignas\(\d+\) (\w+) (\w+)\[(\d+)\];", source)}
    operands = re.findall(r"\(\((unsigned|float) \*\)\((\w+) \+ (\d+)\)\)\[(\d+)\]", source)
    assert operands, "no mma operands found"
    for _ctype, name, off, idx in operands:
        decl, size = arrays[name]
        end = int(off) * _ELEM_BYTES[decl] + (int(idx) + 1) * 4
        assert end <= size * _ELEM_BYTES[decl], f"{name} ({decl}[{size}]) read at byte {end}"


# ---------------------------------------------------------------------------------------------
# GPU numerics (device)

EPILOGUES = ["none", "bias", "residual", "swiglu", "rmsnorm"]


class _Block(torch.nn.Module):
    """One Linear (N, K) with ``epilogue`` the way a user writes it."""

    def __init__(self, k: int, n: int, epilogue: str) -> None:
        super().__init__()
        self.epilogue = epilogue
        self.lin = torch.nn.Linear(k, n, bias=epilogue == "bias")
        self.up = torch.nn.Linear(k, n, bias=False) if epilogue == "swiglu" else None
        self.norm = torch.nn.RMSNorm(k, eps=1e-5) if epilogue == "rmsnorm" else None

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        y = self.lin(x)
        if self.up is not None:
            y = torch.nn.functional.silu(y) * self.up(x)
        return y + r if self.epilogue == "residual" else y


GPU_GRID = [(m, n, k, e) for m in (1, 4, 16, 64) for (n, k) in ((4096, 4096), (1000, 1024))
            for e in EPILOGUES]


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["sm90", "sm80"])
@pytest.mark.parametrize("m, n, k, epilogue", GPU_GRID,
                         ids=[f"{m}x{n}x{k}-{e}" for m, n, k, e in GPU_GRID])
def test_gpu_numerics(m, n, k, epilogue, target, tmp_path):
    import tvmfuse

    torch.manual_seed(0)
    module = _Block(k, n, epilogue).half().eval()
    with torch.no_grad():
        if module.norm is not None:
            module.norm.weight.normal_(1.0, 0.1)
    inputs = (torch.randn(m, k).half(), torch.randn(m, n).half())
    lib = tvmfuse.compile(module, inputs, target=target)
    run = tvmfuse.load(lib.export(tmp_path / "m.so"), device="cuda")
    out = run(*(t.cuda() for t in inputs))
    with torch.no_grad():
        ref = module.float()(*(t.float() for t in inputs))
    err = float((out.float().cpu() - ref).norm() / ref.norm())
    assert err < 1e-2, err


def _gemv_reference(x, w, pair: bool, eps: float | None):
    """float64 ``standalone``: ``y = x·Wᵀ`` (RMS-normalised x), pair: ``silu(y₂c) · y₂c₊₁``."""
    x, w = x.astype("float64"), w.astype("float64")
    if eps is not None:
        x = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    y = x @ w.T
    if pair:
        a, b = y[:, 0::2], y[:, 1::2]
        y = a / (1 + np.exp(-a)) * b
    return y


def _check_standalone_on_the_gpu(p: GemvProblem, cfg: GemvConfig, stats: bool, seed: int,
                                 preload: bool = False) -> None:
    """``standalone(p, cfg)`` built for sm90 and run on random inputs against float64 numpy."""
    dev = tvm.cuda()
    eps = 1e-5 if stats else None
    func = standalone(p, cfg, rms_eps=eps, preload=preload)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=SM90.tvm_target())
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((p.m, p.k)).astype("float16")
    w = (rng.standard_normal((p.n, p.k)) / np.sqrt(p.k)).astype("float16")
    y = tvm.runtime.empty((p.m, p.n // 2 if p.pair else p.n), "float16", dev)
    lib(tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev), y)
    ref = _gemv_reference(x, w, p.pair, eps)
    err = np.linalg.norm(y.numpy().astype("float64") - ref) / np.linalg.norm(ref)
    assert err < 2e-3, err


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, pair, stats, cfg", RING_CASES, ids=RING_IDS)
def test_ring_numerics_on_the_gpu(m, n, k, pair, stats, cfg):
    """H200: the ring engine against float64 numpy on random inputs (rows of W and chunks of K
    past the ends zero-filled, M below the 8-column tile, the statistics and the pair epilogue)."""
    _check_standalone_on_the_gpu(GemvProblem(m, n, k, "float16", "float16", pair), cfg, stats,
                                 m * 7 + k)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, pair, stats", PRELOAD_CASES, ids=PRELOAD_IDS)
def test_preload_numerics_on_the_gpu(m, n, k, pair, stats):
    """H200 (run on an H100 in session 25): the preloading kernel (launched plainly: its wait
    returns at once) against float64."""
    p = GemvProblem(m, n, k, "float16", "float16", pair)
    _check_standalone_on_the_gpu(p, pick_config(p, 132, row_stats=stats), stats, m * 5 + n,
                                 preload=True)
