"""Norms as users write them in fp16/bf16 modules: one norm op with fp32 statistics, folded into
the following Linear (FuseDecomposedNorms → NormGemmPrologue), as fp32 models get.

Structure tests give the spelling torch.export / the ONNX exporters produce (Before) and the norm
op it must become (Expected), under TVM's ``testing.immutable_module`` check. User-style tests
write each norm the way transformers / torch users do, in an fp16 or bf16 module followed by a
Linear, compile it for the CPU, count the kernels and compare with torch's fp32-statistics result.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from torch import nn
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tests.conftest import rel_err
from tests.relax_util import assert_same_numerics
from tvmfuse.passes import FuseDecomposedNorms, NormGemmPrologue

EPS = 1e-6
EPS32 = float(np.float32(EPS))  # the pass reads eps from the graph's fp32 constant
D, N = 64, 96


def _immutable(pass_: tvm.transform.Pass, mod: tvm.IRModule) -> tvm.IRModule:
    """Run ``pass_`` with TVM checking that it does not write into ``mod``."""
    with tvm.transform.PassContext(config={"testing.immutable_module": True}):
        return pass_(mod)


# --- structure: the spellings the exporters produce ------------------------------------------

@I.ir_module
class TwoUpcasts:
    """Item 3 / T5 through torch.export: ``x.float()`` twice (square branch, product branch), the
    weight applied in fp16 after the cast back."""

    @R.function
    def main(x: R.Tensor((4, 64), "float16"), w: R.Tensor((64,), "float16")) -> R.Tensor((4, 64), "float16"):
        with R.dataflow():
            a = R.astype(x, "float32")
            sq = R.power(a, R.const(2.0, "float32"))
            ms = R.mean(sq, axis=[-1], keepdims=True)
            b = R.astype(x, "float32")
            ve = R.add(ms, R.const(1e-6, "float32"))
            inv = R.rsqrt(ve)
            n = R.multiply(b, inv)
            h = R.astype(n, "float16")
            y = R.multiply(h, w)
            R.output(y)
        return y


@I.ir_module
class TwoUpcastsExpected:
    @R.function
    def main(x: R.Tensor((4, 64), "float16"), w: R.Tensor((64,), "float16")) -> R.Tensor((4, 64), "float16"):
        with R.dataflow():
            y = R.nn.rms_norm(x, w, axes=[-1], epsilon=EPS32)
            R.output(y)
        return y


@I.ir_module
class WeightInFp32:
    """nn.RMSNorm / F.rms_norm in fp16 (ONNX dynamo spelling): the weight multiplies in fp32, then
    one cast back; the exporter has already made the weight fp32."""

    @R.function
    def main(x: R.Tensor((4, 64), "bfloat16"),
             w: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "bfloat16"):
        with R.dataflow():
            a = R.astype(x, "float32")
            sq = R.power(a, R.const(2.0, "float32"))
            ms = R.mean(sq, axis=[1], keepdims=True)
            ve = R.add(ms, R.const(1e-6, "float32"))
            sd = R.sqrt(ve)
            inv = R.divide(R.const(1.0, "float32"), sd)
            n = R.multiply(a, inv)
            s = R.multiply(n, w)
            y = R.astype(s, "bfloat16")
            R.output(y)
        return y


@I.ir_module
class WeightInFp32Expected:
    @R.function
    def main(x: R.Tensor((4, 64), "bfloat16"),
             w: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "bfloat16"):
        with R.dataflow():
            a = R.astype(x, "float32")
            s = R.nn.rms_norm(a, w, axes=[-1], epsilon=EPS32)
            y = R.astype(s, "bfloat16")
            R.output(y)
        return y


@I.ir_module
class SquareOnlyUpcast:
    """Square in fp32, product in fp16: no rms_norm computes that; left as it is."""

    @R.function
    def main(x: R.Tensor((4, 64), "float16"), w: R.Tensor((64,), "float16")) -> R.Tensor((4, 64), "float16"):
        with R.dataflow():
            a = R.astype(x, "float32")
            sq = R.power(a, R.const(2.0, "float32"))
            ms = R.mean(sq, axis=[-1], keepdims=True)
            ve = R.add(ms, R.const(1e-6, "float32"))
            inv = R.astype(R.rsqrt(ve), "float16")
            n = R.multiply(x, inv)
            y = R.multiply(n, w)
            R.output(y)
        return y


def _gemma(dtype: str, folded: bool) -> tvm.IRModule:
    """Gemma's RMSNorm (``x̂ · (1 + w.float())`` in fp32, then cast) with a constant weight:
    as torch.export writes it, or (``folded``) as FuseDecomposedNorms must write it."""
    w = np.random.default_rng(0).standard_normal(64).astype("float32") * 0.1
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.astype(x, "float32"))
            if folded:
                s = bb.emit(relax.op.nn.rms_norm(a, relax.const(w.astype(dtype).astype("float32") + 1),
                                                 axes=[-1], epsilon=EPS32))
            else:
                sq = bb.emit(relax.op.power(a, relax.const(2.0, "float32")))
                ms = bb.emit(relax.op.mean(sq, axis=[-1], keepdims=True))
                inv = bb.emit(relax.op.rsqrt(relax.op.add(ms, relax.const(EPS, "float32"))))
                n = bb.emit(relax.op.multiply(a, inv))
                w32 = bb.emit(relax.op.astype(relax.const(w.astype(dtype), dtype), "float32"))
                s = bb.emit(relax.op.multiply(n, bb.emit(relax.op.add(w32, relax.const(1.0, "float32")))))
            y = bb.emit_output(relax.op.astype(s, dtype))
        bb.emit_func_output(y)
    return relax.transform.CanonicalizeBindings()(bb.get())


@pytest.mark.parametrize("before, expected", [(TwoUpcasts, TwoUpcastsExpected),
                                              (WeightInFp32, WeightInFp32Expected)],
                         ids=["two_upcasts", "weight_in_fp32"])
def test_half_rms_norm_becomes_one_op(before, expected):
    after = _immutable(FuseDecomposedNorms(), before)
    tvm.ir.assert_structural_equal(after, expected)
    # The fp16 weight applied after the cast back is one rounding less in rms_norm (fp32 inside).
    assert_same_numerics(before, after, rtol=2e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gemma_weight_is_folded_to_an_fp32_constant(dtype):
    before = _gemma(dtype, folded=False)
    after = _immutable(FuseDecomposedNorms(), before)
    tvm.ir.assert_structural_equal(after, _gemma(dtype, folded=True))
    assert_same_numerics(before, after, rtol=1e-3)


def test_mixed_precision_branches_are_left_alone():
    after = _immutable(FuseDecomposedNorms(), SquareOnlyUpcast)
    tvm.ir.assert_structural_equal(after, SquareOnlyUpcast)


def _half_norm_linear(dtype: str, residual: bool) -> tvm.IRModule:
    """``astype(rms_norm(astype(x, f32), g32), half)`` → Linear (64 → 96, or 64 → 64 with the
    normed tensor added back as a residual)."""
    rng = np.random.default_rng(1)
    n = 64 if residual else 96
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 8, 64), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.astype(x, "float32"))
            g = relax.const(rng.standard_normal(64).astype("float32"))
            h = bb.emit(relax.op.astype(relax.op.nn.rms_norm(a, g, axes=[-1], epsilon=EPS), dtype))
            flat = bb.emit(relax.op.reshape(h, [16, 64]))
            w = relax.const((rng.standard_normal((64, n)) * 0.1).astype(dtype))
            out = bb.emit(relax.op.matmul(flat, w, out_dtype="float32"))
            if residual:
                out = bb.emit(relax.op.add(relax.op.reshape(relax.op.astype(out, dtype), [2, 8, 64]), h))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_norm_computed_in_fp32_folds_into_the_gemm(dtype):
    before = _half_norm_linear(dtype, residual=False)
    after = _immutable(NormGemmPrologue(), before)
    script = after["main"].script()
    assert "R.nn.rms_norm" not in script and "rms_norm_stats" in script
    # The GEMM reads x in half precision, not an fp32 copy: no cast of x is left.
    assert "R.astype(x" not in script
    assert_same_numerics(before, after, rtol=5e-3 if dtype == "bfloat16" else 1e-3)


def test_half_norm_needed_elsewhere_is_not_folded():
    """The normed tensor is also the residual: no fold; the norm becomes one kernel instead
    (HalfNormOneKernel, tests/test_pass_norm_half_io.py) that the GEMM reads."""
    before = _half_norm_linear("float16", residual=True)
    after = _immutable(NormGemmPrologue(), before)
    script = after.script()
    assert "rms_norm_stats" not in script and "R.nn.rms_norm" not in script
    assert script.count("R.call_tir(cls.rms_norm, (x,") == 1, script
    assert_same_numerics(before, after, rtol=1e-3)


# --- user-style: the modules as users write them ---------------------------------------------

class LlamaRMS(nn.Module):
    """transformers' LlamaRMSNorm (Mistral / Qwen2 are the same), verbatim."""

    def __init__(self, d: int = D, eps: float = EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Item3RMS(LlamaRMS):
    """Issue 13 item 3: ``.float()`` twice, weight after the cast back."""

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype) * self.weight


class WeightBeforeCast(LlamaRMS):
    """The weight multiplied in fp32, then one cast back."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * self.weight.float()).to(x.dtype)


class FRms(LlamaRMS):
    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


class FLayerNorm(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.w, self.b, 1e-5)


def _transformers_norm(kind: str) -> nn.Module:
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        return LlamaRMSNorm(D, eps=EPS)
    if kind == "gemma":
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

        return GemmaRMSNorm(D, eps=EPS)
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return T5LayerNorm(D, eps=EPS)


NORMS = {
    "hf_llama": lambda: _transformers_norm("llama"),
    "hf_gemma": lambda: _transformers_norm("gemma"),
    "hf_t5": lambda: _transformers_norm("t5"),
    "llama_verbatim": LlamaRMS,
    "item3": Item3RMS,
    "weight_before_cast": WeightBeforeCast,
    "F.rms_norm": FRms,
    "nn.RMSNorm": lambda: nn.RMSNorm(D, eps=EPS),
    "F.layer_norm": FLayerNorm,
    "nn.LayerNorm": lambda: nn.LayerNorm(D),
}


class NormLinear(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm, self.lin = norm, nn.Linear(D, N, bias=False)

    def forward(self, x):
        return self.lin(self.norm(x))


def _norm_linear(name: str, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    """``name``'s norm + Linear at random (non-trivial) weights, in ``dtype``, and an input."""
    torch.manual_seed(0)
    module = NormLinear(NORMS[name]())
    with torch.no_grad():
        for pname, p in module.norm.named_parameters():  # ones / zeros at init: make them count
            p.copy_(torch.randn_like(p) * 0.1 + (0 if "b" == pname or "bias" in pname
                                                 or name == "hf_gemma" else 1))
    return module.to(dtype).eval(), torch.randn(2, 8, D).to(dtype)


def _fp32_stats_reference(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the half module computes with fp32 statistics: the same module run in fp32."""
    import copy

    with torch.no_grad():
        return copy.deepcopy(module).float()(x.float())


def _kernels(mod: tvm.IRModule, target: str = "cpu") -> list[dict]:
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    return analyze(mod, get_target(target))["kernels"]


def _stats_then_gemm(kernels: list[dict]) -> bool:
    """The CPU's norm + Linear: a row-statistics kernel, then one GEMM applying them."""
    return (len(kernels) == 2 and len(kernels[0]["ops"]) == 1 and kernels[0]["ops"][0].endswith("_norm_stats")
            and "matmul" in kernels[1]["ops"])


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_norm_then_linear_folds_on_cpu(name, dtype):
    import tvmfuse
    from tvmfuse.frontend import import_model

    module, x = _norm_linear(name, dtype)
    kernels = _kernels(import_model(module, (x,)).mod)
    assert _stats_then_gemm(kernels), [(k["pattern"], k["ops"]) for k in kernels]
    out = tvmfuse.compile(module, (x,), target="cpu").load()(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert out.dtype == dtype
    err = rel_err(out, _fp32_stats_reference(module, x))
    assert err <= (1e-2 if dtype == torch.bfloat16 else 2e-3), f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("name", ["item3", "hf_gemma", "nn.RMSNorm", "nn.LayerNorm"])
def test_norm_then_linear_is_one_sm90_kernel(name):
    """On sm_90a the GEMM computes the statistics itself: norm + Linear is one launch."""
    from tvmfuse.frontend import import_model

    module, x = _norm_linear(name, torch.float16)
    kernels = _kernels(import_model(module, (x,)).mod, "sm90")
    assert [k["pattern"] for k in kernels] == ["norm_gemm"], [(k["pattern"], k["ops"]) for k in kernels]


@pytest.mark.parametrize("name, exporter, opset", [
    ("item3", "legacy", 17), ("hf_gemma", "legacy", 17), ("nn.RMSNorm", "dynamo", 18),
    ("nn.RMSNorm", "dynamo", 23),  # opset 23: the exporter writes ONNX RMSNormalization
])
def test_onnx_export_folds_on_cpu(name, exporter, opset, tmp_path):
    """The same fp16 modules through torch.onnx.export: statistics kernel + GEMM, torch's numbers."""
    import contextlib
    import io

    import tvmfuse
    from tvmfuse.frontend import import_model

    module, x = _norm_linear(name, torch.float16)
    path = tmp_path / f"{exporter}{opset}.onnx"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        torch.onnx.export(module, (x,), str(path), dynamo=exporter == "dynamo", opset_version=opset)
    if opset == 23:
        import onnx

        assert "RMSNormalization" in {n.op_type for n in onnx.load(str(path)).graph.node}
    kernels = _kernels(import_model(str(path)).mod)
    assert _stats_then_gemm(kernels), [(k["pattern"], k["ops"]) for k in kernels]
    out = tvmfuse.compile(str(path), target="cpu").load()(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    err = rel_err(out, _fp32_stats_reference(module, x))
    assert err <= 2e-3, f"{name} via {exporter} opset {opset}: relative error {err:.2e}"


class NormResidual(nn.Module):
    """The normed tensor feeds a Linear and the residual: no fold, one norm kernel."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm, self.lin = norm, nn.Linear(D, D, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.lin(h) + h


@pytest.mark.parametrize("name", ["item3", "hf_gemma", "nn.RMSNorm", "nn.LayerNorm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_norm_needed_elsewhere_is_one_kernel(name, dtype):
    import tvmfuse
    from tvmfuse.frontend import import_model

    folded, x = _norm_linear(name, dtype)
    module = NormResidual(folded.norm).to(dtype).eval()
    kernels = _kernels(import_model(module, (x,)).mod)
    norms = [k["ops"] for k in kernels if "matmul" not in k["ops"]]
    assert len(kernels) == 2 and norms in ([["rms_norm"]], [["layer_norm"]]), \
        [(k["pattern"], k["ops"]) for k in kernels]
    out = tvmfuse.compile(module, (x,), target="cpu").load()(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    err = rel_err(out, _fp32_stats_reference(module, x))
    assert err <= (1e-2 if dtype == torch.bfloat16 else 2e-3), f"{name}: relative error {err:.2e}"
