"""Sm90ProducerRowStats: an RMSNorm's sums of squares written by the GEMM that produced its input.

CPU: which statistics kernels go (a residual GEMM's output, RMSNorm or LayerNorm, sm_90a) and
which stay (sm80, the option off, a norm of a non-GEMM tensor); the partial-sum parameters'
shapes; the report; the kernels compile for sm_90a with no spills. GPU: residual + norm + Linear
blocks with ragged M and N (a partial last column tile; LayerNorm on rows whose mean is ~3 standard
deviations) and the 4-layer LM's shape class against float64 torch.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from tvm import tirx

import tvmfuse
from models.decoder_layer import RMSNorm
from tests.cuda_tools import check_vs_float64, kernel_sass, needs_nvcc
from tvmfuse.frontend import import_model
from tvmfuse.options import Options, use_options
from tvmfuse.pipeline import lower
from tvmfuse.targets import get_target


class ResidualNormLinear(nn.Module):
    """``h = x + a·W1ᵀ;  y = norm(h)·W2ᵀ + h``: the first Linear's epilogue writes the residual
    stream the norm reads (a pre-norm block's shape), x (M, K), a (M, K2)."""

    def __init__(self, k: int, k2: int, n: int, norm: str = "rms") -> None:
        super().__init__()
        self.proj = nn.Linear(k2, k, bias=False)
        self.norm = nn.LayerNorm(k) if norm == "layer" else RMSNorm(k)
        self.out = nn.Linear(k, n, bias=False)
        self.gate = nn.Linear(k, n, bias=False)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(a)
        n = self.norm(h)
        return self.out(n) * torch.sigmoid(self.gate(n)) + h[:, : self.out.out_features]


class Logits(nn.Module):
    """A transformers causal LM as ``input_ids → logits`` (no cache)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


def _model(m: int, k: int, k2: int, n: int, dtype=torch.float16, norm: str = "rms", seed: int = 0):
    """The block and its inputs; x's rows have mean ≈ 3·std (LayerNorm's cancellation case)."""
    torch.manual_seed(seed)
    module = ResidualNormLinear(k, k2, n, norm).to(dtype).eval()
    return module, ((torch.randn(m, k) + 3).to(dtype), (torch.randn(m, k2) / 8).to(dtype))


def _kernels(module, inputs, target: str = "sm90", **options) -> dict[str, tirx.PrimFunc]:
    with use_options(Options(**options)):
        mod = lower(import_model(module, inputs).mod, get_target(target))
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


@pytest.mark.parametrize("norm, rows", [("rms", 2), ("layer", 4)])
def test_residual_gemm_writes_the_partial_sums(norm, rows):
    """The statistics kernel goes; the residual GEMM gains a (⌈N/BN⌉, M) fp32 output (LayerNorm:
    2·⌈N/BN⌉, each tile's mean and M2), and each GEMM after the norm reads it where it read rstd
    (M = 1000 rows, N = 328: two column tiles); LayerNorm's mean parameter goes."""
    funcs = _kernels(*_model(1000, 328, 512, 256, norm=norm), sm90_producer_stats_layernorm=True)
    assert not any(name.endswith("norm_stats") for name in funcs), sorted(funcs)
    (producer,) = [f for name, f in funcs.items() if name.endswith("_partials")]
    consumers = [f for name, f in funcs.items() if name.endswith("_partial_stats")]
    assert len(consumers) >= 1, sorted(funcs)
    partials = producer.params[-1]
    # its stores are masked at the true M and N (not at the partials' row count)
    bounds = set(re.findall(r"< (\d+)", producer.script()))
    assert {"1000", "328"} <= bounds and str(rows) not in bounds, bounds
    shape = tuple(int(d) for d in partials.shape)
    assert shape == (rows, 1000) and str(partials.dtype) == "float32"
    for f in consumers:
        shapes = [tuple(int(d) for d in p.shape) for p in f.params]
        assert (rows, 1000) in shapes and (1000, 1) not in shapes, shapes
        assert "T.rsqrt" in f.script()


@pytest.mark.parametrize("target, norm, options, why", [
    ("sm90", "layer", {}, "LayerNorm partials off by default"),
    ("sm80", "layer", {"sm90_producer_stats_layernorm": True}, "sm80"),
    ("sm80", "rms", {}, "sm80"),
    ("sm90", "rms", {"sm90_producer_stats": False}, "option off"),
])
def test_statistics_kernel_stays(target, norm, options, why):
    """LayerNorm's shifted sums, other targets and the option off keep the statistics kernel."""
    funcs = _kernels(*_model(256, 256, 256, 256, norm=norm), target=target,
                     sm90_in_loop_stats=False, **options)
    assert any(name.endswith("norm_stats") for name in funcs), (why, sorted(funcs))
    assert not any(name.endswith("_partials") for name in funcs), (why, sorted(funcs))


def test_llama_lm_keeps_only_the_embedding_norms_kernel():
    """The 4-layer LM's shape class, two layers: of five RMSNorms the four after a residual GEMM
    take their sums from it; the first (after the embedding gather) keeps its kernel."""
    from models import llama_lm

    module, inputs = llama_lm.build(vocab=512, hidden=1024, n_layers=2, n_heads=8, n_kv_heads=2,
                                    ffn=2816, seq=2048)
    funcs = _kernels(module, inputs)
    assert sum(name.startswith("rms_norm_stats") for name in funcs) == 1, sorted(funcs)
    assert sum(name.endswith("_partials") for name in funcs) == 2  # O-proj, down (per layer)
    off = _kernels(module, inputs, sm90_producer_stats=False)
    assert sum(name.startswith("rms_norm_stats") for name in off) == 1  # one function, 5 calls


def test_each_kernel_is_built_once_for_every_layer(monkeypatch):
    """The layers call the same fused PrimFuncs: each (PrimFunc, arguments) kernel is built once
    a pass, not once per statistics call (two layers: four plans over two producer kernels)."""
    import tvm_ffi

    from models import llama_lm
    from tvmfuse.rules import gemm_sm90_producer_stats as rule

    built = []

    def counting(func, **kwargs):
        built.append((tvm_ffi.structural_hash(func), tuple(sorted(kwargs.items()))))
        return real(func, **kwargs)

    real = rule.build_kernel
    monkeypatch.setattr(rule, "build_kernel", counting)
    module, inputs = llama_lm.build(vocab=512, hidden=1024, n_layers=2, n_heads=8, n_kv_heads=2,
                                    ffn=2816, seq=2048)
    funcs = _kernels(module, inputs)
    assert sum(name.endswith("_partials") for name in funcs) == 2, sorted(funcs)
    producers = [k for k in built if ("partials_out", True) in k[1]]
    assert len(producers) == 2, producers  # O-proj and down, for both layers
    assert len(built) == len(set(built)), built


def test_report_names_the_merged_statistics():
    """``tvmfuse report``: the producer lists its fused function's ops under this rule; the GEMM
    after the norm lists the statistics first (they are formed there); no boundary leads from the
    producer into a statistics kernel, and the producer → GEMM boundary says what crosses it."""
    from tvmfuse.report import analyze

    module, inputs = _model(1000, 328, 512, 256)
    report = analyze(import_model(module, inputs).mod, get_target("sm90"), "float16", stock=False)
    by_name = {k["name"]: k for k in report["kernels"]}
    (producer,) = [k for n, k in by_name.items() if n.endswith("_partials")]
    assert producer["rule"] == "gemm_sm90_producer_stats" and producer["ops"][0] == "matmul"
    consumers = [k for n, k in by_name.items() if n.endswith("_partial_stats")]
    assert consumers and all(k["ops"][0] == "rms_norm_stats" for k in consumers)
    edges = [e for e in report["not_fused"] if e["kernels"][0] == producer["name"]]
    assert edges and not any("norm_stats" in e["kernels"][1] for e in edges), edges
    assert any("row sums of squares" in e["reason"] for e in edges), edges


@pytest.mark.parametrize("source", ["transformers", "onnx-legacy", "onnx-dynamo"])
def test_fires_on_models_as_users_bring_them(source, tmp_path):
    """transformers' Llama at random init (fp16), and the fp32 LM through both ONNX exporters
    compiled in fp16: every RMSNorm after a residual GEMM takes its producer's partial sums, the
    first (after the embedding gather) stays in-loop, no statistics kernel is left."""
    from tvmfuse.report import analyze

    if source == "transformers":
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=512)
        torch.manual_seed(0)
        llama = transformers.LlamaForCausalLM(cfg).half().eval()
        model = import_model(Logits(llama), (torch.randint(0, 1000, (1, 256)),))
    else:
        from models import llama_lm
        from models.export_onnx import export_onnx

        module, inputs = llama_lm.build(vocab=512, hidden=256, n_layers=2, n_heads=4, n_kv_heads=2,
                                        ffn=512, seq=128, dtype=torch.float32)
        dynamo = source == "onnx-dynamo"
        model = import_model(str(export_onnx(module, inputs, tmp_path / "lm.onnx", dynamo=dynamo,
                                             opset=18 if dynamo else 17)))
    names = [k["name"] for k in analyze(model.mod, get_target("sm90"), "float16",
                                        stock=False)["kernels"]]
    assert not any(n.startswith("rms_norm_stats") for n in names), names
    assert sum(n.endswith("_partials") for n in names) == 4, names  # O and down, two layers


@needs_nvcc
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_kernels_compile_without_spills(norm, tmp_path):
    """Export: the producer's quad sums (LayerNorm: joins) are SHFL.BFLY; HGMMA in every GEMM
    kernel; the consumer's rsqrt; no local-memory spills."""
    module, inputs = _model(1000, 328, 512, 256, norm=norm)
    with use_options(Options(sm90_producer_stats_layernorm=True)):
        path = tvmfuse.compile(module, inputs, target="sm90").export(tmp_path / "m.so")
    kernels = kernel_sass(path)["sm_90a"]
    producer = [s for name, s in kernels.items() if "_partials" in name]
    consumer = [s for name, s in kernels.items() if "_partial_stats" in name]
    assert producer and consumer, sorted(kernels)
    assert all("HGMMA" in s and "SHFL.BFLY" in s for s in producer)
    assert all("HGMMA" in s and "MUFU.RSQ" in s for s in consumer)
    assert not any("STL" in s for s in producer + consumer)  # no local-memory spills


# ---------------------------------------------------------------------------------------------
# GPU numerics against float64 torch


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("m, k, k2, n, dtype, tol", [
    (1000, 328, 512, 256, torch.float16, 5e-3),    # ragged M, a partial last column tile
    (2048, 2048, 2048, 1024, torch.float16, 5e-3),  # full tiles, a cluster pair
    (300, 1024, 640, 512, torch.bfloat16, 2e-2),
], ids=["ragged-fp16", "full-fp16", "bf16"])
def test_gpu_residual_norm_linear(m, k, k2, n, dtype, tol, norm, tmp_path):
    module, inputs = _model(m, k, k2, n, dtype, norm)
    with use_options(Options(sm90_producer_stats_layernorm=True)):
        check_vs_float64(module, inputs, "sm90", tmp_path, tol)


@pytest.mark.gpu
def test_gpu_llama_lm(tmp_path):
    """Several persistent tiles a CTA; every norm but the first from partial sums."""
    from models import llama_lm

    module, inputs = llama_lm.build(vocab=2048, hidden=1024, n_layers=2, n_heads=8, n_kv_heads=2,
                                    ffn=2816, seq=2048)
    check_vs_float64(module, inputs, "sm90", tmp_path, 5e-3)


@pytest.mark.gpu
def test_gpu_gpt2_layernorm(tmp_path):
    """transformers' GPT-2 at random init in fp16: its LayerNorms after the residual GEMMs take
    their (mean, rstd) from the producers' tile partials (the option on; passed on an H100,
    session 32)."""
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=1000, n_positions=512)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).half().eval()
    ids = torch.randint(0, 1000, (1, 256), generator=torch.Generator().manual_seed(0))
    with use_options(Options(sm90_producer_stats_layernorm=True)):
        check_vs_float64(Logits(model), (ids,), "sm90", tmp_path, 1e-2)
