"""Canonicalisation end to end, as a user meets it: one plain fp16 torch module, compiled from torch
and from its ONNX exports (dynamo and legacy exporters), gives the same kernels and the sm90 wgmma
GEMM for every projection; on the cpu target its outputs match torch and onnxruntime.

The module is a pre-norm MLP block with an output head computed in fp32 as users write one
(``(h.float() @ w.float().T).to(h.dtype)``): Linear on 3-D activations (ONNX: MatMul (B, S, K)·(K, N) + Add),
fp16 matmuls (ONNX: no fp32 accumulator) and an explicit upcast (ONNX: an fp32 initializer).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvmfuse
from tests.cuda_tools import needs_nvcc
from tvmfuse.frontend import import_model
from tvmfuse.targets import get_target

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `models` lives at the repo root, next to tests/
    sys.path.insert(0, str(REPO_ROOT))

from models.export_onnx import export_onnx  # noqa: E402

SOURCES = ["torch", "onnx-dynamo", "onnx-legacy"]
N_GEMMS = 3  # fc1, fc2, head


class Block(nn.Module):
    """``logits = (h.float() @ head.float().T).half()``, ``h = x + fc2(gelu(fc1(norm(x))))``, fp16."""

    def __init__(self, hidden: int = 64, ffn: int = 256, vocab: int = 128) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return (h.float() @ self.head.weight.float().T).to(x.dtype)


def _block() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    module = Block().half().eval()
    with torch.no_grad():
        module.norm.weight.normal_(1.0, 0.1)
        module.norm.bias.normal_(0.0, 0.1)
    return module, (torch.randn(2, 16, 64, dtype=torch.float16),)


def _model(source: str, tmp_path: Path):
    """``(model, example_inputs)`` for tvmfuse.compile: the module, or its ONNX export."""
    module, inputs = _block()
    if source == "torch":
        return module, inputs
    path = tmp_path / f"{source}.onnx"
    export_onnx(module, inputs, path, opset=18, dynamo=source == "onnx-dynamo")
    return str(path), None


@pytest.mark.parametrize("source", SOURCES)
def test_cpu_matches_reference(source, tmp_path):
    """cpu target: the torch module against torch in fp32, an ONNX export against onnxruntime."""
    model, inputs = _model(source, tmp_path)
    lib = tvmfuse.compile(model, inputs, target="cpu")
    module, (x,) = _block()
    out = np.asarray(lib.load()(x.numpy()), np.float64)
    if source == "torch":
        with torch.no_grad():
            ref = module.float()(x.float()).double().numpy()
    else:
        ref = np.asarray(lib.model.reference(x.numpy())[0], np.float64)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert out.shape == (2, 16, 128) and err <= 5e-3, err


def _gemm_rules(model, inputs) -> list[tuple[str, str | None]]:
    """``(rule, fallback)`` of every GEMM PrimFunc after lowering for sm90."""
    from tvmfuse.pipeline import lower

    mod = lower(import_model(model, inputs).mod, get_target("sm90"))
    out = []
    for _, f in mod.functions_items():
        attrs = getattr(f, "attrs", None)
        if attrs is None or "tirx.noalias" not in attrs:
            continue
        rule, fallback = attrs.get("tvmfuse.rule"), attrs.get("tvmfuse.fallback")
        if rule in ("gemm_sm90", "gemm_sm80") or fallback is not None:
            out.append((str(rule), None if fallback is None else str(fallback)))
    return out


def test_sm90_every_projection_on_wgmma(tmp_path):
    """Lowered for sm90: from torch and both ONNX exports each of the three GEMMs takes the wgmma
    rule and none records a fallback; the ONNX exports launch as many kernels as torch's."""
    from tvmfuse.report import analyze

    counts = {}
    for source in SOURCES:
        model, inputs = _model(source, tmp_path)
        assert _gemm_rules(model, inputs) == [("gemm_sm90", None)] * N_GEMMS, source
        counts[source] = analyze(import_model(model, inputs).mod, get_target("sm90"))["fused_kernel_count"]
    assert len(set(counts.values())) == 1, counts


def _sass_functions(sass: str) -> dict[str, str]:
    """``{function name: its SASS}`` from ``cuobjdump -sass`` output."""
    parts = re.split(r"\n\s*Function : (\S+)", sass)
    return dict(zip(parts[1::2], parts[2::2]))


@needs_nvcc
@pytest.mark.parametrize("source", ["onnx-dynamo", "onnx-legacy"])
def test_sm90_sass_has_hgmma_per_projection(source, tmp_path):
    """compile → export for sm90: three kernels in the fatbin issue HGMMA (one per projection)."""
    from tvmfuse.build.inspect import cuda_images, fatbin_sass

    model, inputs = _model(source, tmp_path)
    path = tvmfuse.compile(model, inputs, target="sm90").export(tmp_path / "m.so")
    (fmt, code), = cuda_images(path)
    assert fmt == "fatbin"
    funcs = _sass_functions(fatbin_sass(code)["sm_90a"])
    hgmma = [name for name, text in funcs.items() if "HGMMA" in text]
    assert len(hgmma) == N_GEMMS, sorted(funcs)
