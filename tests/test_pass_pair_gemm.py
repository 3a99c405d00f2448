"""PairGemm: silu(x·W_a) ⊙ (x·W_b) with constant weights → one interleaved GEMM + pair epilogue."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from torch import nn
from tvm import relax

import tvmfuse
from tvmfuse.passes.pair_gemm import PairGemm
from tvmfuse.targets import get_target

M, K, N = 16, 32, 64


def _weights():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((K, N)).astype("float16"), rng.standard_normal((K, N)).astype("float16"))


def _before(wg: np.ndarray, wu: np.ndarray) -> tvm.IRModule:
    """main(x) = astype(x·Wg) → silu, times astype(x·Wu) (the torch import after mixed precision)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((M, K), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.matmul(x, relax.const(wg), out_dtype="float32"))
            a16 = bb.emit(relax.op.astype(a, "float16"))
            gate = bb.emit(relax.op.nn.silu(a16))
            b = bb.emit(relax.op.matmul(x, relax.const(wu), out_dtype="float32"))
            b16 = bb.emit(relax.op.astype(b, "float16"))
            out = bb.emit_output(relax.op.multiply(gate, b16))
        bb.emit_func_output(out)
    return bb.get()


def _expected(wg: np.ndarray, wu: np.ndarray) -> tvm.IRModule:
    """W[:, 2j] = Wg[:, j], W[:, 2j+1] = Wu[:, j]; the epilogue reads the even/odd columns."""
    w_il = np.empty((K, 2 * N), "float16")
    w_il[:, 0::2], w_il[:, 1::2] = wg, wu
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((M, K), "float16"))
    w = relax.Var("w", relax.TensorType((K, 2 * N), "float16"))
    with bb.function("fused_matmul_pair", [x, w], {"Primitive": True}, private=True):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
            even = bb.emit(relax.op.strided_slice(y, [1], [0], [2 * N], [2]))
            odd = bb.emit(relax.op.strided_slice(y, [1], [1], [2 * N], [2]))
            gate = bb.emit(relax.op.nn.silu(bb.emit(relax.op.astype(even, "float16"))))
            up = bb.emit(relax.op.astype(odd, "float16"))
            out = bb.emit_output(relax.op.multiply(gate, up))
        bb.emit_func_output(out)
    gv = bb.get().get_global_var("fused_matmul_pair")
    x2 = relax.Var("x", relax.TensorType((M, K), "float16"))
    with bb.function("main", [x2]):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(gv, [x2, relax.const(w_il)]))
        bb.emit_func_output(out)
    return bb.get()


def test_swiglu_becomes_one_interleaved_gemm():
    wg, wu = _weights()
    with get_target("cpu").tvm_target():
        after = PairGemm()(_before(wg, wu))
    tvm.ir.assert_structural_equal(after, _expected(wg, wu))


@pytest.mark.parametrize("target", ["sm80", "cpu_other_use"])
def test_left_alone(target):
    """sm80 has no pair-epilogue GEMM kernel; a gate used elsewhere too must stay materialised."""
    wg, wu = _weights()
    before = _before(wg, wu)
    if target == "cpu_other_use":
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((M, K), "float16"))
        with bb.function("main", [x]):
            with bb.dataflow():
                a = bb.emit(relax.op.matmul(x, relax.const(wg)))
                b = bb.emit(relax.op.matmul(x, relax.const(wu)))
                out = bb.emit_output(relax.Tuple([relax.op.multiply(relax.op.nn.silu(a), b), a]))
            bb.emit_func_output(out)
        before = bb.get()
        target = "cpu"
    with get_target(target).tvm_target():
        after = PairGemm()(before)
    tvm.ir.assert_structural_equal(after, before)


def test_sm90_needs_k_multiple_of_8():
    rng = np.random.default_rng(1)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((M, 20), "float16"))
    w1, w2 = (relax.const(rng.standard_normal((20, N)).astype("float16")) for _ in range(2))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.multiply(relax.op.nn.silu(relax.op.matmul(x, w1)),
                                                   relax.op.matmul(x, w2)))
        bb.emit_func_output(out)
    before = relax.transform.Normalize()(bb.get())
    with get_target("sm90").tvm_target():
        after = PairGemm()(before)
    tvm.ir.assert_structural_equal(after, before)


class ConstSwiGLU(nn.Module):
    """``silu(x·Wgᵀ) ⊙ (x·Wuᵀ)`` with Wg, Wu (N, K) parameters: constants to tvmfuse."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.wg = nn.Parameter(torch.randn(n, k, generator=g) / k**0.5)
        self.wu = nn.Parameter(torch.randn(n, k, generator=g) / k**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(F.linear(x, self.wg)) * F.linear(x, self.wu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_matches_unfused_graph(dtype, tmp_path):
    """llvm: the one-GEMM form gives the unfused graph's numbers on random inputs."""
    from tvmfuse.frontend import import_model
    from tvmfuse.pipeline import lower

    module = ConstSwiGLU(96, 64).to(dtype).eval()
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    mod = lower(import_model(module, (x,)).mod, get_target("cpu"))
    names = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert sum("matmul" in n for n in names) == 1 and any("pair" in n for n in names), names
    run = tvmfuse.load(tvmfuse.compile(module, (x,), target="cpu").export(tmp_path / "m.so"),
                       device="cpu")
    out = torch.as_tensor(np.asarray(run(x.numpy()))).double()
    with torch.no_grad():
        ref = module(x).double()  # eager: two GEMMs, silu and the product in the model's dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (out - ref).abs().max().item() <= tol * ref.abs().max().item()
