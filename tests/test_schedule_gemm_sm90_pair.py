"""sm_90a GEMM with a pair epilogue (PairGemm's SwiGLU): one wgmma kernel, x read once.

CPU: the fused ``fused_matmul_pair`` PrimFunc becomes the TIRx kernel (N/2-wide output, fp32
epilogue) and builds with nvcc to HGMMA + UTMALDG. GPU: numerics against a float64 reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tvmfuse
from tests.conftest import rel_err
from tests.test_pass_pair_gemm import ConstSwiGLU, NormSwiGLU
from tests.test_schedule_gemm_sm90 import _lowered_funcs, _ptxas_kernels, needs_cuobjdump
from tvmfuse.build.inspect import cuda_images, fatbin_sass
from tvmfuse.kernels.gemm.epilogue import analyze
from tvmfuse.rules.gemm_sm90 import NAME


def _x(m: int, k: int, dtype) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype)


def test_pair_function_is_read_as_pair_epilogue():
    """The fused function reads C at (i, 2j) and (i, 2j + 1): two accumulators, out is N/2 wide."""
    import tvm

    from tvmfuse.frontend import import_model
    from tvmfuse.pipeline import lower
    from tvmfuse.targets import get_target

    module = ConstSwiGLU(512, 256).half().eval()
    seen = {}
    lower(import_model(module, (_x(256, 256, torch.float16),)).mod, get_target("sm90"),
          on_stage=lambda name, mod: seen.setdefault(name, mod))
    (func,) = [f for gv, f in seen["reshape_to_view"].functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint]
    g = analyze(func)
    assert g.acc_odd is not None and (g.m, g.n, g.k) == (256, 1024, 256)
    assert g.out_shape == (256, 512)
    assert "acc_odd" in str(g.expr) and "sigmoid" in str(g.expr)


@needs_cuobjdump
@pytest.mark.parametrize("n, m, k, hgmma", [
    (512, 256, 256, "HGMMA.64x256x16.F32.BF16"),
    # the 4-layer LM's gate/up pair (2N = 11264 at M = 2048): 128×176 tiles fill the last wave
    # (select_config); ragged M
    pytest.param(5632, 2000, 512, "HGMMA.64x176x16.F32.BF16", marks=pytest.mark.slow)],
    ids=["128x256", "128x176"])
def test_swiglu_is_one_sm90_kernel(n, m, k, hgmma, tmp_path, monkeypatch):
    """One GEMM kernel (not two), the pair store into the (M, N) output; nvcc: HGMMA of the
    tile's width, no spills."""
    module = ConstSwiGLU(n, k).to(torch.bfloat16).eval()
    inputs = (_x(m, k, torch.bfloat16),)
    funcs = _lowered_funcs(module, inputs)
    gemm = [f for f in funcs.values() if f.attrs.get("tvmfuse.rule") == NAME]
    assert len(gemm) == 1
    text = gemm[0].script()
    assert f"({m}, {n})" in text and "T.cuda.__shfl_xor_sync" in text  # N/2-wide, lane swap
    from tvmfuse.build import export

    logs = []
    real = export.compile_fatbin

    def keep_log(src, spec, workdir, name="kernels"):
        fatbin = real(src, spec, workdir, name)
        logs.append((Path(workdir) / f"{name}.ptxas.log").read_text())
        return fatbin

    monkeypatch.setattr(export, "compile_fatbin", keep_log)
    path = tvmfuse.compile(module, inputs, target="sm90").export(tmp_path / "m.so")
    (fmt, code), = cuda_images(path)
    sass = fatbin_sass(code)["sm_90a"]
    assert hgmma in sass and "UTMALDG" in sass
    kernels = _ptxas_kernels(logs[0])
    assert kernels and all(spill == 0 for _, spill in kernels.values()), kernels


def test_norm_mlp_mixed_precision_is_one_sm90_kernel():
    """fp32 RMSNorm + SwiGLU at --dtype float16: stats kernel, then one pair GEMM (row scale and
    gate in its epilogue); no elementwise kernel for silu(gate)·up."""
    from tvmfuse.frontend import import_model
    from tvmfuse.pipeline import lower
    from tvmfuse.targets import get_target

    module = NormSwiGLU(512, 256).eval()
    mod = lower(import_model(module, (_x(128, 256, torch.float32),)).mod, get_target("sm90"),
                dtype="float16")
    import tvm

    funcs = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    gemm = [n for n, f in funcs.items() if f.attrs.get("tvmfuse.rule") == NAME]
    assert gemm == ["fused_matmul_pair"], sorted(funcs)
    assert not any("sigmoid" in f.script() for n, f in funcs.items() if n not in gemm)


# (M, N, K): tile-aligned; ragged M with N not a multiple of the tile (2N = 1040) and a K tail;
# the 4-layer LM's pair width on 128×176 tiles (select_config) with ragged M
PAIR_CASES = [(512, 1024, 512), (1000, 520, 1000), (16, 2048, 1024), (2000, 5632, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 5e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("m, n, k", PAIR_CASES)
def test_gpu_swiglu_pair(m, n, k, dtype, tol, tmp_path):
    module = ConstSwiGLU(n, k).to(dtype).eval()
    x = _x(m, k, dtype)
    lib = tvmfuse.compile(module, (x,), target="sm90")
    run = tvmfuse.load(lib.export(tmp_path / "m.so"), device="cuda")
    out = run(x.cuda())
    with torch.no_grad():
        ref = ConstSwiGLU(n, k).double()(x.double())
    assert rel_err(out, ref) <= tol


@pytest.mark.gpu
def test_gpu_norm_mlp_mixed_precision(tmp_path):
    module = NormSwiGLU(1024, 512).eval()
    x = _x(1000, 512, torch.float32)
    lib = tvmfuse.compile(module, (x,), target="sm90", dtype="float16")
    run = tvmfuse.load(lib.export(tmp_path / "m.so"), device="cuda")
    out = run(x.cuda())
    with torch.no_grad():
        ref = module.double()(x.double())
    assert rel_err(out, ref) <= 1e-2


def test_lm_pair_reads_its_weight_transposed_for_the_176_tile():
    """At the 4-layer LM's pair width the (K, N) constant B becomes its (N, K) transpose, made at
    compile time (128×176 tiles need B K-major): one kernel reading the transpose, the (K, N)
    constant gone; a width where both layouts get the same tile keeps (K, N)."""
    import numpy as np
    import tvm

    from tvmfuse.frontend import import_model
    from tvmfuse.passes._util import const_array
    from tvmfuse.pipeline import lower
    from tvmfuse.targets import get_target

    def stages(n):
        seen = {}
        module = ConstSwiGLU(n, 512).half().eval()
        lower(import_model(module, (_x(2000, 512, torch.float16),)).mod, get_target("sm90"),
              on_stage=lambda name, mod: seen.setdefault(name, mod))
        return seen

    def pair_weights(mod):
        out = []
        for _, f in mod.functions_items():
            if isinstance(f, tvm.relax.Function):
                tvm.relax.analysis.post_order_visit(f, lambda e: out.extend(
                    (e.args[0].name_hint, const_array(a)) for a in (e.args[1].fields if isinstance(
                        e, tvm.relax.Call) and getattr(e.op, "name", "") == "relax.call_tir" else [])
                    if isinstance(a, tvm.ir.expr.Constant) and "pair" in e.args[0].name_hint))
        return out

    seen = stages(5632)
    (name0, before), = pair_weights(seen["gemm_row_stats_simt"])
    (name1, after), = pair_weights(seen["gemm_sm90"])
    assert before.shape == (512, 11264) and name1 == f"{name0}_nt"
    np.testing.assert_array_equal(after, before.T)
    assert seen["gemm_sm90"][name1].attrs["tvmfuse.tile"] == "128x176x64 stages=5"
    seen = stages(512)  # 2N = 1024 at M = 2000: 128×256 either way
    (name1, after), = pair_weights(seen["gemm_sm90"])
    assert after.shape == (512, 1024) and not name1.endswith("_nt")


@pytest.mark.parametrize("quad", [True, False])
def test_pair_value_loads_stay_inside_in_bounds_tested_tiles(quad):
    """A pair value is computed before its bounds test (the lanes shuffle it first): in a tile
    past row M its (row, col) are clamped into (M, N/2), so an epilogue operand read there (here
    an (M, N/2) residual) is never read past its end; full tiles read it unclamped."""
    from tvm import tirx
    from tvm.script import tirx as T

    from tvmfuse.kernels.gemm.sm90 import GemmConfig, GemmProblem, gemm_kernel

    m, n, k = 300, 512, 256
    bufs = [tirx.decl_buffer(shape, "float16", name=name, data_alignment=16) for name, shape in
            (("A", (m, k)), ("B", (n, k)), ("C", (m, n // 2)), ("R", (m, n // 2)))]

    def pair_value(acc, acc_odd, row, col, stats):
        return T.Cast("float16", acc * acc_odd + T.Cast("float32", bufs[3][row, col]))

    text = gemm_kernel(GemmProblem(m, n, k, "float16", "float16", "nt"), GemmConfig(quad_store=quad),
                       bufs, 0, 1, 2, pair_value=pair_value).script()
    reads = set(re.findall(r"\bR(?:_\d+)?\[([^\]]*)\]", text))
    assert reads and any(r.startswith("T.min(row, 299)") for r in reads), reads
    assert any(r.startswith("row,") for r in reads), reads  # full tiles: as they are
