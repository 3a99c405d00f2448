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
from tvmfuse.options import Options, use_options
from tvmfuse.passes.pair_gemm import PairGemm
from tvmfuse.targets import get_target

M, K, N = 16, 32, 64


def _weights():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((K, N)).astype("float16"), rng.standard_normal((K, N)).astype("float16"))


def _before(wg: np.ndarray, wu: np.ndarray, m: int = M) -> tvm.IRModule:
    """main(x) = astype(x·Wg) → silu, times astype(x·Wu) (the torch import after mixed precision)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, K), "float16"))
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


@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_swiglu_becomes_one_interleaved_gemm(target):
    """cpu; sm80 at decode size (M = 16 ≤ 64: the weight-streaming kernel takes the pair)."""
    wg, wu = _weights()
    with get_target(target).tvm_target(), use_options(Options(gemv_max_m=64)):
        after = PairGemm()(_before(wg, wu))
    tvm.ir.assert_structural_equal(after, _expected(wg, wu))


def test_input_module_is_not_modified():
    wg, wu = _weights()
    before = _before(wg, wu)
    with get_target("cpu").tvm_target():
        PairGemm()(before)
    tvm.ir.assert_structural_equal(before, _before(wg, wu))


@pytest.mark.parametrize("target", ["sm80", "cpu_other_use"])
def test_left_alone(target):
    """sm80 above decode size (M = 128 > 64) has no pair-epilogue GEMM kernel; a gate used
    elsewhere too must stay materialised."""
    wg, wu = _weights()
    before = _before(wg, wu, m=128)
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


def _wide(w: np.ndarray, scale_first: bool = True, cut: str = "slices") -> tvm.IRModule:
    """HorizontalGemm + NormGemmPrologue's form: x·[Wg | Wu] · rstd (per row), then the halves:
    two slices, ``split`` in two (``chunk(2, -1)``), or slices with an open end (``y[:, N:]``)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((M, K), "float16"))
    s = relax.Var("s", relax.TensorType((M, 1), "float32"))
    with bb.function("main", [x, s]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(w), out_dtype="float32"))
            z = bb.emit(relax.op.multiply(y, s))
            if cut == "split":
                parts = bb.emit(relax.op.split(z, 2, axis=-1))
                gate, up = bb.emit(relax.TupleGetItem(parts, 0)), bb.emit(relax.TupleGetItem(parts, 1))
            else:
                gate = bb.emit(relax.op.strided_slice(z, [1], [0], [N]))
                up = bb.emit(relax.op.strided_slice(z, [1], [N], [2**63 - 1 if cut == "open_end"
                                                                 else 2 * N]))
            out = bb.emit_output(relax.op.multiply(relax.op.nn.silu(gate), up))
        bb.emit_func_output(out)
    return relax.transform.Normalize()(bb.get())


@pytest.mark.parametrize("cut", ["slices", "split", "open_end"])
def test_wide_gemm_halves_become_interleaved(cut):
    """One (K, 2N) GEMM sliced into halves: its columns are interleaved, the row scale stays on
    the GEMM result (a parameter of the grouped function), the halves become stride-2 slices."""
    wg, wu = _weights()
    with get_target("cpu").tvm_target():
        after = PairGemm()(_wide(np.concatenate([wg, wu], axis=1), cut=cut))
    w_il = np.empty((K, 2 * N), "float16")
    w_il[:, 0::2], w_il[:, 1::2] = wg, wu
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((M, K), "float16"))
    w = relax.Var("w", relax.TensorType((K, 2 * N), "float16"))
    s = relax.Var("s", relax.TensorType((M, 1), "float32"))
    with bb.function("fused_matmul_pair", [x, w, s], {"Primitive": True}, private=True):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
            z = bb.emit(relax.op.multiply(y, s))
            even = bb.emit(relax.op.strided_slice(z, [1], [0], [2 * N], [2]))
            odd = bb.emit(relax.op.strided_slice(z, [1], [1], [2 * N], [2]))
            gate = bb.emit(relax.op.nn.silu(even))
            out = bb.emit_output(relax.op.multiply(gate, odd))
        bb.emit_func_output(out)
    gv = bb.get().get_global_var("fused_matmul_pair")
    x2 = relax.Var("x", relax.TensorType((M, K), "float16"))
    s2 = relax.Var("s", relax.TensorType((M, 1), "float32"))
    with bb.function("main", [x2, s2]):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(gv, [x2, relax.const(w_il), s2]))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(after, bb.get())


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


class NormSwiGLU(nn.Module):
    """RMSNorm (weight gamma) feeding a constant-weight SwiGLU: Llama's MLP without down_proj."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.mlp = ConstSwiGLU(n, k)
        self.gamma = nn.Parameter(torch.rand(k, generator=torch.Generator().manual_seed(3)) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        return self.mlp(x * rstd * self.gamma)


def _launches(mod: tvm.IRModule) -> int:
    """Kernel launches in main: call_tir bindings."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    return sum(isinstance(b.value, relax.Call) and b.value.op.same_as(call_tir)
               for blk in mod["main"].body.blocks for b in blk.bindings)


@pytest.mark.parametrize("shape", [(2, 24, 64), (48, 64)])
def test_cpu_mixed_precision_norm_mlp_same_as_without_pass(shape, monkeypatch, tmp_path):
    """fp32 model at --dtype float16, norm folded into the GEMMs (3-D x: gate/up merged by
    HorizontalGemm, halves sliced; 2-D x: two GEMMs, rstd in the epilogue): the pair form gives
    the numbers of the pipeline without PairGemm, in fewer kernels."""
    import tvmfuse.pipeline as pipeline
    from tvmfuse.frontend import import_model

    module = NormSwiGLU(96, 64).eval()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    outs, counts = {}, {}
    for variant in ("pair", "off"):
        if variant == "off":
            monkeypatch.setattr(pipeline, "PairGemm", lambda: (lambda m: m))
        seen = {}
        pipeline.lower(import_model(module, (x,)).mod, get_target("cpu"), dtype="float16",
                       on_stage=lambda name, m, seen=seen: seen.setdefault(name, m))
        counts[variant] = _launches(seen["reshape_to_view"])
        lib = tvmfuse.compile(module, (x,), target="cpu", dtype="float16")
        run = tvmfuse.load(lib.export(tmp_path / f"{variant}.so"), device="cpu")
        outs[variant] = np.asarray(run(x.numpy()))
    assert counts["pair"] < counts["off"], counts
    np.testing.assert_allclose(outs["pair"], outs["off"], rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        ref = module(x).numpy()
    assert np.linalg.norm(outs["pair"] - ref) <= 1e-2 * np.linalg.norm(ref)
