"""sm_90a GEMMs with a symbolic M (``--dynamic S=LO..HI``): one wgmma kernel per bucket of rows.

A fused GEMM whose M is a symbol bounded by the module's ``tir_var_upper_bound`` becomes one
function that branches on M at run time between kernels laid out for M ≤ 64 (64×128 tiles),
M ≤ 512 and the bound (``rules/gemm_sm90.bucket_configs``); each reads the runtime M into its
tensor map, raster and store masks. Before, such GEMMs fell back to dlight's CUDA-core matmul
("symbolic shape"). CPU tests check the configs, the function's structure, the fallback without
a bound and the SASS; the ``gpu`` test compares lengths in every bucket with torch.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvmfuse
from tests.cuda_tools import needs_nvcc
from tvmfuse.attrs import FALLBACK_ATTR, KERNEL_TILE_ATTR, RULE_ATTR
from tvmfuse.build.inspect import cuda_source, fatbin_sass
from tvmfuse.build.nvcc import compile_fatbin
from tvmfuse.kernels.gemm.epilogue import NotHandled, analyze
from tvmfuse.rules.gemm_sm90 import NAME, bucket_configs, build_kernel
from tvmfuse.targets import get_target

HI = 1024


class Mlp(nn.Module):
    """``x + W2 · gelu(W1 · x + b1)`` in fp16: two GEMMs (bias + GELU, residual epilogues)."""

    def __init__(self, hidden: int = 256, ffn: int = 512) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def _model():
    torch.manual_seed(0)
    return Mlp().half().eval(), torch.randn(1, 8, 256, dtype=torch.float16)


def _lowered(dynamic=True):
    from tvmfuse.frontend import dynamic_ranges, import_model, input_overrides
    from tvmfuse.pipeline import lower

    module, x = _model()
    overrides = input_overrides({"x": "1xSx256"})
    imported = import_model(module, (x,), overrides, dynamic_ranges({"S": (1, HI)}))
    mod = imported.mod
    if not dynamic:  # the same module without the symbol's bounds
        main = mod["main"]
        mod = mod.clone()
        mod["main"] = main.without_attr("tir_var_upper_bound").without_attr("tir_var_lower_bound")
    return lower(mod, get_target("sm90"))


def test_bucket_configs():
    """64-row tiles for decode-size M, then the default tile choice at each bucket's top."""
    got = bucket_configs(4096, 2048, sms=132)
    assert [top for top, _ in got] == [64, 512, 4096]
    assert (got[0][1].bm, got[0][1].bn) == (64, 128)
    assert all(cfg.bm == 128 for _, cfg in got[1:])
    assert [top for top, _ in bucket_configs(300, 2048, sms=132)] == [64, 300]
    assert [top for top, _ in bucket_configs(64, 2048, sms=132)] == [64]


def test_symbolic_gemms_get_one_kernel_per_bucket():
    mod = _lowered()
    gemms = {gv.name_hint: f for gv, f in mod.functions_items()
             if getattr(f, "attrs", None) is not None and str(f.attrs.get(RULE_ATTR, "")) == NAME}
    assert len(gemms) == 2, sorted(gv.name_hint for gv, _ in mod.functions_items())
    for name, func in gemms.items():
        assert FALLBACK_ATTR not in func.attrs, name
        tiles = str(func.attrs[KERNEL_TILE_ATTR])
        assert tiles.count("(M<=") == 3 and "(M<=64)" in tiles and f"(M<={HI})" in tiles, tiles
        assert str(func.params[0].shape[0]) == "S", name  # A's rows: the symbol itself
        assert func.script().count("if ") >= 2  # the run-time branch between the buckets


def test_without_a_bound_the_gemm_falls_back_with_the_reason():
    mod = _lowered(dynamic=False)
    reasons = [str(f.attrs[FALLBACK_ATTR]) for _, f in mod.functions_items()
               if getattr(f, "attrs", None) is not None and FALLBACK_ATTR in f.attrs]
    assert reasons and any("without an upper bound" in r for r in reasons), reasons


def test_analyze_keeps_static_m_by_default():
    """Callers that did not ask for a symbolic M (GEMV, in-loop statistics) still see NotHandled."""
    from tvm import te, tirx

    m = tirx.Var("S", "int64")
    k = te.reduce_axis((0, 64), "k")
    a = te.placeholder((m, 64), "float16", "a")
    w = te.placeholder((32, 64), "float16", "w")
    c = te.compute((m, 32), lambda i, j: te.sum(a[i, k].astype("float32") * w[j, k].astype(
        "float32"), axis=k), name="c")
    y = te.compute((m, 32), lambda i, j: c[i, j].astype("float16"), name="y")
    func = te.create_prim_func([a, w, y])
    with pytest.raises(NotHandled, match="symbolic"):
        analyze(func)
    assert str(analyze(func, symbolic_m=True).m) == "S"
    with pytest.raises(NotHandled, match="upper bound"):
        build_kernel(func, ranges={})
    assert "M<=" in str(build_kernel(func, ranges={"S": (1, 100)}).attrs[KERNEL_TILE_ATTR])


@needs_nvcc
def test_buckets_build_to_hgmma_with_nvcc(tmp_path):
    """Each GEMM function is three kernels in the CUDA source; nvcc builds them for sm_90a with
    HGMMA of both tile widths and TMA loads."""
    module, x = _model()
    lib = tvmfuse.compile(module, (x,), target="sm90", inputs={"x": "1xSx256"},
                          dynamic={"S": (1, HI)})
    src = cuda_source(lib.executable)
    names = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+(?:, \d+)?\) )?(\w+)\(", src))
    for base in {n.rsplit("_kernel", 1)[0] for n in names if "matmul" in n}:
        assert {f"{base}_kernel", f"{base}_kernel_1", f"{base}_kernel_2"} <= names, sorted(names)
    sass = fatbin_sass(compile_fatbin(src, get_target("sm90"), tmp_path))["sm_90a"]
    assert "HGMMA.64x128x16.F32" in sass and "HGMMA.64x256x16.F32" in sass
    assert "UTMALDG" in sass


@pytest.mark.gpu
def test_every_bucket_on_the_gpu(tmp_path):
    """H200: lengths in each bucket and at its edges against torch's fp16 module on the GPU."""
    module, x = _model()
    lib = tvmfuse.compile(module, (x,), target="sm90", inputs={"x": "1xSx256"},
                          dynamic={"S": (1, HI)})
    run = tvmfuse.load(lib.export(tmp_path / "mlp.so"), device="cuda")
    module = module.cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    for s in (1, 37, 64, 65, 300, 512, 513, 1000, HI):
        xs = torch.randn(1, s, 256, dtype=torch.float16, device="cuda", generator=g)
        with torch.no_grad():
            ref = module(xs).double()
        out = torch.as_tensor(run(xs)).to("cuda").double()
        assert out.shape == ref.shape, s
        err = float((out - ref).norm() / ref.norm())
        assert err < 5e-3, (s, err)
