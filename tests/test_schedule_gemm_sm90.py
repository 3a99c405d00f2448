"""sm_90a GEMM path: TIRx kernel generation, pipeline integration, SASS checks, GPU numerics.

CPU tests build with nvcc for sm_90a and read the SASS back with cuobjdump (HGMMA = wgmma,
UTMALDG = TMA tile load) and the ptxas report (no local-memory spills). ``gpu`` tests compare
the exported library with an fp32 torch reference on random inputs.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvmfuse
from tests.conftest import rel_err
from tvmfuse.build.inspect import cuda_images, fatbin_sass, find_cuobjdump
from tvmfuse.build.nvcc import compile_fatbin
from tvmfuse.kernels.gemm.sm90 import GemmConfig, GemmProblem, standalone
from tvmfuse.rules.gemm_sm90 import FALLBACK_ATTR, NAME, TIRX_ATTR
from tvmfuse.targets import get_target

needs_cuobjdump = pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump not found")


class LinearAct(nn.Module):
    """``act(x @ w.T + b) (+ r)``: x (M, K), w (N, K), b (N), r (M, N)."""

    def __init__(self, act: str = "relu", residual: bool = False) -> None:
        super().__init__()
        self.act, self.residual = act, residual

    def forward(self, x, w, b, *rest):
        y = F.linear(x, w, b)
        y = {"relu": torch.relu, "gelu": F.gelu, "none": lambda t: t}[self.act](y)
        return y + rest[0] if self.residual else y


class SwiGLU(nn.Module):
    """``silu(x @ wg.T) * (x @ wu.T)``: x (M, K), wg / wu (N, K)."""

    def forward(self, x, wg, wu):
        return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def _inputs(m, n, k, dtype, residual=False, device="cpu"):
    g = torch.Generator().manual_seed(0)
    t = [torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5,
         torch.randn(n, generator=g)]
    if residual:
        t.append(torch.randn(m, n, generator=g))
    return tuple(x.to(dtype).to(device) for x in t)


def _lowered_funcs(module, inputs, target="sm90"):
    from tvmfuse.frontend import import_model
    from tvmfuse.pipeline import lower

    mod = lower(import_model(module, inputs).mod, get_target(target))
    return {gv.name_hint: f for gv, f in mod.functions_items()
            if hasattr(f, "attrs") and f.attrs is not None and "tirx.noalias" in f.attrs}


def _ptxas_kernels(log: str) -> dict[str, tuple[int, int]]:
    """``{kernel: (registers, spill bytes)}`` from a ptxas -v report."""
    out, name = {}, None
    for line in log.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            name = m.group(1)
        elif name and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            out[name] = (0, int(m.group(1)) + int(m.group(2)))
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            out[name] = (int(m.group(1)), out.get(name, (0, 0))[1])
    return out


def test_select_config_fills_the_last_wave():
    """128×176 tiles (no cluster) where they fill the last wave much better than 128×256 and B is
    (N, K); (K, N) B needs 64-column tiles; 128×192 where that fills it better still."""
    from tvmfuse.kernels.gemm.sm90 import check
    from tvmfuse.rules.gemm_sm90 import select_config

    lm_pair = select_config(2048, 11264, 132)  # 704 tiles of 128×256 = 5.33 waves; 1024 of 176
    assert (lm_pair.bn, lm_pair.cluster_m) == (176, 1)
    assert select_config(2048, 11264, 132, layout="nn").bn == 256
    assert check(GemmProblem(2048, 11264, 2048, "float16", "float16", "nn"), lm_pair) is not None
    assert check(GemmProblem(2048, 11264, 2048, "float16", "float16", "nt"), lm_pair) is None
    assert select_config(2048, 22016, 132).bn == 256  # the 7B pair: the same wave cost
    assert select_config(2048, 3072, 132).bn == 192
    assert select_config(2048, 2048, 132).bn == 256  # one wave: the tile's size counts


@needs_cuobjdump
@pytest.mark.parametrize("layout, dtype, cfg", [
    ("nt", "float16", GemmConfig()),
    ("nn", "bfloat16", GemmConfig()),
    ("nt", "bfloat16", GemmConfig(bn=128, stages=6)),
    ("nn", "float16", GemmConfig(bm=64, bn=128, stages=4, ctas_per_sm=2, producer_regs=40,
                                 consumer_regs=216)),
    ("nt", "float16", GemmConfig(cluster_m=2, warp_release=True)),
    ("nn", "bfloat16", GemmConfig(bn=128, stages=6, cluster_m=2)),
    ("nt", "float16", GemmConfig(bm=64, stages=5, pingpong=True, warp_release=True)),
    ("nn", "float16", GemmConfig(bm=64, stages=5, pingpong=True, cluster_m=2, warp_release=True)),
    ("nt", "bfloat16", GemmConfig(bn=128, stages=6, pingpong=True, cluster_m=2, warp_release=True)),
    ("nn", "float16", GemmConfig(bm=256, bn=128, wg_rows=128, cluster_m=2, warp_release=True)),
    ("nt", "float16", GemmConfig(bn=176, stages=5)),  # select_config's tile for the LM's pair
])
def test_kernel_sass_has_hgmma_and_tma(layout, dtype, cfg, tmp_path, monkeypatch):
    """The generated kernel compiles for sm_90a to HGMMA + UTMALDG with no spills."""
    import tvm

    monkeypatch.setenv("TVM_COMPILE_FORCE_FALLBACK", "1")
    prob = GemmProblem(1000, 512, 320, dtype, dtype, layout)  # ragged M, K tail of 0 after 5 tiles
    lib = tvm.compile(tvm.IRModule({"main": standalone(prob, cfg)}),
                      target=get_target("sm90").tvm_target(), tir_pipeline="tirx")
    src = lib.mod.imports[0].inspect_source()
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.bn}k16" in src
    if cfg.ctas_per_sm > 1:  # two co-resident CTAs: ptxas must fit 65536 / (2 x 256) registers
        assert f"__launch_bounds__({cfg.threads}, {cfg.ctas_per_sm})" in src
    fatbin = compile_fatbin(src, get_target("sm90"), tmp_path)
    sass = fatbin_sass(fatbin)["sm_90a"]
    assert f"HGMMA.64x{cfg.bn}x16.F32" in sass
    assert "UTMALDG" in sass
    if cfg.cluster_m > 1:  # B halves multicast to the CTA pair; stages freed in both CTAs
        assert "multicast::cluster" in src and "mbarrier.arrive.shared::cluster" in src
        assert "UTMALDG.2D.MULTICAST" in sass, sorted({ln.split()[0] for ln in sass.split(";")
                                                      if "UTMA" in ln})
    kernels = _ptxas_kernels((tmp_path / "kernels.ptxas.log").read_text())
    assert kernels and all(spill == 0 for _, spill in kernels.values()), kernels


@needs_cuobjdump
@pytest.mark.parametrize("m", [2048, 300])  # every tile full; ragged M (a bounds-tested tile)
def test_quad_store_loads_bias_and_residual_as_vectors(m, tmp_path):
    """Plain quad store: the lanes exchange fp32 accumulators and evaluate the epilogue where
    the 8 outputs land, so the (N,) bias and (M, N) residual load as one 16-byte vector each, at
    the store's own position and inside its bounds test (no read past row M)."""
    inputs = _inputs(m, 512, 256, torch.float16, residual=True)
    funcs = _lowered_funcs(LinearAct("relu", residual=True), inputs)
    (func,) = [f for f in funcs.values() if f.attrs.get("tvmfuse.rule") == NAME]
    lines = [ln.strip() for ln in func.script().splitlines()]
    bias = "ov[0:8] = p2[T.Ramp(col // 8 * 8, 1, 8)]"
    res = "ov[8:16] = p3[row, T.Ramp(col // 8 * 8, 1, 8)]"
    assert lines.count(bias) == lines.count(res) == (1 if m % 128 == 0 else 2)
    assert not any("p3[" in ln and "T.Ramp" not in ln for ln in lines)  # no scalar residual read
    if m % 128:  # the guarded copy tests the row before it loads
        guard = lines.index(f"if row < {m} and col < 512:")
        assert lines.index(res, guard) == guard + 2
    lib = tvmfuse.compile(LinearAct("relu", residual=True), inputs, target="sm90")
    (_, code), = cuda_images(lib.export(tmp_path / "m.so"))
    sass = fatbin_sass(code)["sm_90a"]
    # all 128-bit: a residual load per store, a bias load per row pair (the two rows share it)
    stores = sass.count("STG.E.128")
    assert sass.count("LDG.E.128") >= stores * 3 // 2 and stores > 0
    assert "LDG.E.U16" not in sass


def test_pipeline_replaces_fused_gemm():
    """On sm90 the fused GEMM + bias + ReLU PrimFunc becomes the TIRx kernel; on sm80 it does not."""
    inputs = _inputs(256, 512, 384, torch.float16)
    funcs = _lowered_funcs(LinearAct("relu"), inputs)
    gemm = [f for f in funcs.values() if f.attrs.get("tvmfuse.rule") == NAME]
    assert len(gemm) == 1 and gemm[0].attrs[TIRX_ATTR]
    funcs80 = _lowered_funcs(LinearAct("relu"), inputs, target="sm80")
    assert not any(f.attrs.get("tvmfuse.rule") == NAME for f in funcs80.values())


def test_fallback_reason_recorded():
    """K not a multiple of 8 cannot use TMA: the function keeps the default path, with the reason."""
    funcs = _lowered_funcs(LinearAct("relu"), _inputs(64, 128, 100, torch.float16))
    reasons = [str(f.attrs[FALLBACK_ATTR]) for f in funcs.values() if FALLBACK_ATTR in f.attrs]
    assert reasons and "K=100" in reasons[0]
    assert not any(f.attrs.get("tvmfuse.rule") == NAME for f in funcs.values())


@needs_cuobjdump
@pytest.mark.parametrize("module, residual", [(LinearAct("gelu", residual=True), True),
                                              (SwiGLU(), False)])
def test_export_holds_sm90_kernel(module, residual, tmp_path):
    """compile → export: the library's fatbin holds the wgmma kernel with its epilogue, no spills."""
    if isinstance(module, SwiGLU):
        x, w, _ = _inputs(256, 512, 256, torch.bfloat16)
        inputs = (x, w, w.flip(0).contiguous())
    else:
        inputs = _inputs(256, 512, 256, torch.bfloat16, residual=residual)
    funcs = _lowered_funcs(module, inputs)
    gemm = [name for name, f in funcs.items() if f.attrs.get("tvmfuse.rule") == NAME]
    assert len(gemm) == (1 if residual else 2)  # SwiGLU: up-projection, then gate GEMM · up
    if residual:  # GELU (erf, or its FAST_MATH16 form with __expf for the bf16 output) and the
        # residual add live in the GEMM kernel, nowhere else
        gelu = [n for n, f in funcs.items() if any(k in f.script() for k in ("T.erf", "__expf"))]
        assert gelu == gemm
    lib = tvmfuse.compile(module, inputs, target="sm90")
    path = lib.export(tmp_path / "m.so")
    (fmt, code), = cuda_images(path)
    assert fmt == "fatbin"
    sass = fatbin_sass(code)["sm_90a"]
    assert "HGMMA.64x256x16.F32.BF16" in sass and "UTMALDG" in sass


class ScaledLinear(nn.Module):
    """``Linear(x) · k`` with ``k`` a 0-d tensor passed in (or fp16 GELU constants after mixed
    precision): a 0-d epilogue parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 512)

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * k


@needs_cuobjdump
def test_scalar_tensor_operand_in_the_epilogue(tmp_path):
    """A 0-d parameter read by the epilogue: TVM 0.27's LowerTIRx flattened ``k[()]`` into a buffer
    nothing declared, and the build failed ("Buffer p3 is used before its definition"; the fp16
    ViT ONNX export under --dtype float16 hit it with GELU's constants). The kernel reads it
    through a one-element view it declares."""
    module = ScaledLinear().half().eval()
    inputs = (torch.randn(256, 256, dtype=torch.float16), torch.tensor(0.5, dtype=torch.float16))
    funcs = _lowered_funcs(module, inputs)
    (func,) = [f for f in funcs.values() if f.attrs.get("tvmfuse.rule") == NAME]
    assert "p3_scalar" in func.script()  # the one-element view (printed without its [0])
    (_, code), = cuda_images(tvmfuse.compile(module, inputs, target="sm90").export(tmp_path / "m.so"))
    assert "HGMMA" in fatbin_sass(code)["sm_90a"]


# ---------------------------------------------------------------------------------------------
# GPU: numerics against an fp32 torch reference

# (M, N, K, activation, residual): tile-aligned, ragged M (2047, 1000), decode M = 16, N not a
# multiple of the 256-wide tile (520), K tails (384, 1000 = 15 full 64-wide tiles + 40)
CASES = [(256, 512, 384, "relu", False), (2047, 1024, 512, "gelu", True),
         (16, 4096, 1024, "none", False), (1000, 520, 1000, "relu", True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 5e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("m, n, k, act, residual", CASES)
def test_gpu_linear_epilogues(m, n, k, act, residual, dtype, tol, tmp_path):
    inputs = _inputs(m, n, k, dtype, residual=residual)
    module = LinearAct(act, residual)
    lib = tvmfuse.compile(module, inputs, target="sm90")
    run = tvmfuse.load(lib.export(tmp_path / "m.so"), device="cuda")
    out = run(*(x.cuda() for x in inputs))
    with torch.no_grad():
        ref = module(*(x.double() for x in inputs))
    assert rel_err(out, ref) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 5e-3), (torch.bfloat16, 2e-2)])
def test_gpu_swiglu(dtype, tol, tmp_path):
    x, wg, _ = _inputs(512, 1024, 512, dtype)
    wu = torch.randn_like(wg.float()).to(dtype) / 512**0.5
    lib = tvmfuse.compile(SwiGLU(), (x, wg, wu), target="sm90")
    run = tvmfuse.load(lib.export(tmp_path / "m.so"), device="cuda")
    out = run(x.cuda(), wg.cuda(), wu.cuda())
    with torch.no_grad():
        ref = SwiGLU()(x.double(), wg.double(), wu.double())
    assert rel_err(out, ref) <= tol


def test_tuning_label_survives_the_kernel_swap():
    """The tuning stage labels a fused GEMM (tuned / default); the TIRx kernel keeps the label."""
    import tvm

    from tvmfuse.frontend import import_model
    from tvmfuse.pipeline import lower
    from tvmfuse.rules.gemm_sm90 import Sm90Gemm

    seen = {}
    lower(import_model(LinearAct("relu"), _inputs(256, 512, 384, torch.float16)).mod,
          get_target("sm90"), on_stage=lambda name, mod: seen.setdefault(name, mod))
    mod = seen["reshape_to_view"]
    (gv,) = [gv for gv, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint]
    mod[gv] = mod[gv].with_attr("tvmfuse.tuning", "default")
    with get_target("sm90").tvm_target():
        out = Sm90Gemm(mod)
    (func,) = [f for g, f in out.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and g.name_hint.startswith(gv.name_hint)]
    assert func.attrs.get("tvmfuse.rule") == NAME
    assert func.attrs["tvmfuse.tuning"] == "default"


@pytest.mark.parametrize("quad", [True, False])
@pytest.mark.parametrize("m, n, fast_only", [(4096, 4096, True), (300, 520, False), (4096, 520, False)])
def test_full_tiles_store_without_guards(m, n, fast_only, quad):
    """Tiles inside (M, N) store without per-element bounds tests; ragged shapes keep the guarded
    copy behind a per-tile test (rows for M, columns for N). ``unguarded_full_tiles=False``: one
    guarded store for every tile. ``quad_store``: the stores are 16-byte vectors of one row
    (``qv``, after the quad's exchange), else column pairs."""
    p = GemmProblem(m, n, 1024, "float16", "float16", "nt")
    text = standalone(p, GemmConfig(quad_store=quad)).script()
    if quad:
        store = "C2[row, col:col + 8] = qv[T.Ramp(0, 1, 8)]"
        guard = f"if row < {m} and col < {n}:"
        assert "pair[T.Ramp(0, 1, 2)]" not in text  # 256 columns: 8 whole groups of four blocks
    else:
        store = "C2[row0 + h * 8, col:col + 2] = pair[T.Ramp(0, 1, 2)]"
        guard = f"if row0 + h * 8 < {m} and col < {n}:"
    assert text.count(store) == (1 if fast_only else 2)
    assert (guard in text) != fast_only
    tile_test = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("if m0 + ", "if n0 + "))]
    expected = " and ".join([f"m0 + 128 <= {m}"] * (m % 128 != 0) + [f"n0 + 256 <= {n}"] * (n % 256 != 0))
    assert tile_test == ([] if fast_only else [f"if {expected}:"])
    guarded = standalone(p, GemmConfig(unguarded_full_tiles=False, quad_store=quad)).script()
    assert guarded.count(store) == 1 and guard in guarded
    assert not any(ln.strip().startswith(("if m0 + ", "if n0 + ")) for ln in guarded.splitlines())


@pytest.mark.parametrize("stats", [None, "consumers", "warps"])
def test_cluster_ctas_drain_their_stages_before_exit(stats, monkeypatch):
    """A CTA of a cluster pair exits only after the release of every stage it loaded (its peer's
    consumers arrive on its ``empty`` barriers remotely): after the TMA thread's loop, one wait
    per stage — whoever computes the row statistics. Without it the H200 reported "unspecified
    launch failure" (session 22: the wait had moved under the statistics warps' branch)."""
    import tvm

    from tvmfuse.kernels.gemm.sm90 import RowStats

    monkeypatch.setenv("TVM_COMPILE_FORCE_FALLBACK", "1")
    cfg = GemmConfig(cluster_m=2, stats_warps=stats == "warps")
    func = standalone(GemmProblem(2048, 512, 2048, "bfloat16", "bfloat16", "nt"), cfg,
                      None if stats is None else RowStats(False, 1e-5))
    src = tvm.compile(tvm.IRModule({"main": func}), target=get_target("sm90").tvm_target(),
                      tir_pipeline="tirx").mod.imports[0].inspect_source()
    loop_waits = 1  # the producer's wait for a free stage inside its loop
    assert src.count("mbarrier_wait((&(empty_ptr[") == loop_waits + cfg.stages, stats


@pytest.mark.gpu
def test_gpu_scalar_tensor_operand(tmp_path):
    from tests.cuda_tools import check_vs_float64

    module = ScaledLinear().half().eval()
    inputs = (torch.randn(256, 256, dtype=torch.float16), torch.tensor(0.5, dtype=torch.float16))
    check_vs_float64(module, inputs, "sm90", tmp_path, 5e-3)
