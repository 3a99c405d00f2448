"""On the H200: memory-bound kernels (``row_norm`` / ``elementwise`` rules) against torch on CUDA.

Each torch module is compiled for sm90, exported, loaded on the GPU and compared with the module
evaluated in float64 on the GPU from the same inputs: ``‖y − ref‖ / ‖ref‖`` ≤ 1e-3 for fp16 and
≤ 1e-5 for fp32, with rows of 4096 (16-byte vectors) and 4100 (not a multiple of 8: 8-byte fp16
vectors, a 205-thread row) columns. Marked ``gpu``: skipped where torch sees no CUDA device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvmfuse
from tests.conftest import rel_err
from tvmfuse.options import Options

pytestmark = pytest.mark.gpu

TOL = {"float16": 1e-3, "float32": 1e-5}


class LayerNorm(nn.Module):
    def forward(self, x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


class RMSNorm(nn.Module):
    def forward(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


class RMSNormHF(nn.Module):
    """LlamaRMSNorm, spelled out."""

    def forward(self, x, w):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h.to(x.dtype)


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


class ScaledMaskedSoftmax(nn.Module):
    """Attention-score softmax: scale, additive mask, softmax over the keys."""

    def forward(self, scores, mask):
        return torch.softmax(scores * 0.125 + mask, dim=-1)


class Chain(nn.Module):
    """add → mul → gelu → cast."""

    def forward(self, x, a, b):
        return F.gelu((x + a) * b).to(torch.float32 if x.dtype == torch.float16 else torch.float16)


def case(name: str, n: int, dtype: torch.dtype) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The module and CPU example inputs of one case (rows: 64, or 2 × 32 / 2 × 4 × 16)."""
    gen = torch.Generator().manual_seed(n)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    if name == "layer_norm":
        return LayerNorm(), (rand(64, n), rand(n), rand(n))
    if name == "rms_norm":
        return RMSNorm(), (rand(2, 32, n), rand(n))
    if name == "rms_norm_hf":
        return RMSNormHF(), (rand(64, n), rand(n))
    if name == "softmax":
        return Softmax(), (rand(64, n),)
    if name == "scaled_masked_softmax":
        return ScaledMaskedSoftmax(), (rand(2, 4, 16, n), rand(16, n))
    if name == "elementwise":
        return Chain(), (rand(64, n), rand(n), rand(64, n))
    raise ValueError(name)


NAMES = ["layer_norm", "rms_norm", "rms_norm_hf", "softmax", "scaled_masked_softmax",
         "elementwise"]


@pytest.mark.parametrize("n", [4096, 4100])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("name", NAMES)
def test_matches_torch(name, dtype, n, tmp_path):
    module, example = case(name, n, getattr(torch, dtype))
    lib = tvmfuse.compile(module, example, target="sm90")
    model = tvmfuse.load(lib.export(tmp_path / f"{name}.so"), device="cuda")
    inputs = [x.cuda() for x in example]
    with torch.no_grad():
        ref = module(*[x.double() for x in inputs])
        eager = module(*inputs)
    y = model(*inputs)
    assert y.device == inputs[0].device and y.dtype == eager.dtype and y.shape == eager.shape
    err = rel_err(y, ref)
    print(f"{name} {dtype} n={n}: rel_err {err:.2e} (torch eager {rel_err(eager, ref):.2e})")
    assert err <= TOL[dtype]


@pytest.mark.parametrize("name, shape, dtype", [
    ("softmax", (2, 4, 16, 16), "float32"),   # 4 lanes a row, 32 rows a thread block
    ("softmax", (3, 100, 128), "float16"),    # 16 lanes a row, 8 rows a block, last block partial
    ("layer_norm", (1000, 768), "float16"),   # one warp a row (3 vectors a lane), 4 rows a block
    ("rms_norm", (37, 96), "float32"),        # 8 lanes a row, 16 rows a block, predicated
    ("layer_norm", (16, 4100), "float32"),    # 205 threads a row: a partial warp
    ("layer_norm", (256, 512), "float32"),    # 64 threads a row (NaN when 2 rows shared a block)
    ("rms_norm", (300, 1024), "float16"),     # 64 threads a row, 300 blocks
])
def test_short_rows(name, shape, dtype, tmp_path):
    """Rows reduced inside one warp (shuffles only) and rows packed several to a thread block."""
    gen = torch.Generator().manual_seed(2)
    dt = getattr(torch, dtype)
    x = torch.randn(*shape, generator=gen).to(dt)
    w, b = torch.randn(shape[-1], generator=gen).to(dt), torch.randn(shape[-1], generator=gen).to(dt)
    module, example = {"softmax": (Softmax(), (x,)), "layer_norm": (LayerNorm(), (x, w, b)),
                       "rms_norm": (RMSNorm(), (x, w))}[name]
    model = tvmfuse.load(tvmfuse.compile(module, example, target="sm90").export(tmp_path / "m.so"),
                         device="cuda")
    inputs = [e.cuda() for e in example]
    with torch.no_grad():
        ref = module(*[e.double() for e in inputs])
    assert rel_err(model(*inputs), ref) <= TOL[dtype]


def test_many_rows_and_rerun(tmp_path):
    """8192 × 4096 fp16 LayerNorm (the benchmark shape): every row right, twice in a row."""
    module, _ = case("layer_norm", 4096, torch.float16)
    gen = torch.Generator().manual_seed(1)
    example = (torch.randn(8192, 4096, generator=gen).half(), torch.randn(4096, generator=gen).half(),
               torch.randn(4096, generator=gen).half())
    model = tvmfuse.load(tvmfuse.compile(module, example, target="sm90").export(tmp_path / "ln.so"),
                         device="cuda")
    inputs = [x.cuda() for x in example]
    with torch.no_grad():
        ref = module(*[x.float() for x in inputs])
    for _ in range(2):
        y = model(*inputs)
        row_err = ((y.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        assert row_err <= 2e-3


class BenchChain(nn.Module):
    """``gelu(x · a + b) · c + d`` (tools/bench/bench_elementwise.py)."""

    def forward(self, x, a, b, c, d):
        return F.gelu(x * a + b) * c + d


@pytest.mark.parametrize("shape", [(64, 4096), (6, 4100), (3, 5, 40)])
@pytest.mark.parametrize("variant", ["v1", "v1_occ8", "v2", "v2_rows", "v4_rows", "v1_erf",
                                     "v4_rows_erf"])
def test_elementwise_variants(variant, shape, tmp_path):
    """Every elementwise schedule variant matches torch on the bench chain in fp16 (rows that the
    k-row variants take whole, rows of 4100 where they fall back, 75 vectors in one block)."""
    gen = torch.Generator().manual_seed(3)
    n = shape[-1]
    example = tuple(torch.randn(*s, generator=gen).half() for s in [shape, (n,), (n,), (n,), shape])
    model = tvmfuse.load(tvmfuse.compile(BenchChain(), example, target="sm90",
                                         options=Options(elementwise_variant=variant))
                         .export(tmp_path / f"{variant}.so"), device="cuda")
    inputs = [e.cuda() for e in example]
    with torch.no_grad():
        ref = BenchChain()(*[e.double() for e in inputs])
    assert rel_err(model(*inputs), ref) <= TOL["float16"]


class RopePack(nn.Module):
    """An LLM prefill's q / k / v out of one QKV projection, RoPE'd by rotate-half and packed flat:
    ``concat(rot(q), rot(k), v)`` (the kernel before the attention). ``shift`` > 0 starts every
    slice that many columns later, so no 16-byte vector of a slice is aligned."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, dim: int = 128, shift: int = 0):
        super().__init__()
        self.heads, self.kv_heads, self.dim, self.shift = heads, kv_heads, dim, shift

    def forward(self, qkv, cos, sin):
        s, d = qkv.shape[0], self.dim

        def piece(start: int, n: int):
            return qkv[:, self.shift + start:self.shift + start + n * d].reshape(s, n, d)

        def rot(x):
            lo, hi = x.chunk(2, dim=-1)
            return x * cos[:, None] + torch.cat([-hi, lo], dim=-1) * sin[:, None]

        q = rot(piece(0, self.heads))
        k = rot(piece(self.heads * d, self.kv_heads))
        v = piece((self.heads + self.kv_heads) * d, self.kv_heads)
        return torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])


def rope_pack_case(shift: int) -> tuple[RopePack, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(5)
    module = RopePack(shift=shift)
    width = (module.heads + 2 * module.kv_heads) * module.dim + shift
    return module, tuple(torch.randn(*s, generator=gen).half()
                         for s in [(64, width), (64, module.dim), (64, module.dim)])


@pytest.mark.parametrize("shift", [0, 3])
@pytest.mark.parametrize("gathers", [True, False])
def test_rope_pack_gathers(shift, gathers, tmp_path):
    """RoPE + pack written as a torch module: the elementwise kernel's gathers (slices,
    concatenations, rotate-half) as 16-byte vectors where aligned and per element where not or
    with ``elementwise_vector_gathers`` off (which loads are vectors:
    ``test_schedules_memory_bound.test_torch_rope_pack_gathers``); equal to torch in float64."""
    module, example = rope_pack_case(shift)
    lib = tvmfuse.compile(module, example, target="sm90",
                          options=Options(elementwise_vector_gathers=gathers))
    model = tvmfuse.load(lib.export(tmp_path / "rope.so"), device="cuda")
    inputs = [x.cuda() for x in example]
    with torch.no_grad():
        ref = module(*[x.double() for x in inputs])
    assert rel_err(model(*inputs), ref) <= TOL["float16"]
