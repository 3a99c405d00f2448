"""Complex tensors as (real, imaginary) pairs (``tvmfuse/frontend/torch_complex.py``).

Before session 45 a program with a complex tensor was refused ("unsupported operators
view_as_complex, view_as_real"): Meta's Llama / Mistral reference RoPE, transformers' Llama 4.
Each module here is compiled for the cpu target and compared with torch on random inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tvmfuse
from tvmfuse.errors import ModelError

B, S, H, D = 2, 24, 4, 16


def _freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """Meta's ``precompute_freqs_cis``: unit complex numbers e^{i·t·f} (end, dim / 2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(t), t)


class MetaRope(torch.nn.Module):
    """Meta's Llama ``apply_rotary_emb`` on q and k (B, S, H, D): a complex buffer sliced to S,
    ``view_as_complex`` of the upcast pairs, a complex product, ``view_as_real(...).flatten(3)``,
    ``type_as`` back."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs_cis", _freqs_cis(D, 2 * S), persistent=False)

    def forward(self, xq: torch.Tensor, xk: torch.Tensor) -> torch.Tensor:
        seq = xq.shape[1]
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        freqs = self.freqs_cis[:seq].view(1, seq, 1, D // 2)
        q = torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq)
        k = torch.view_as_real(xk_ * freqs).flatten(3).type_as(xk)
        return q * 2.0 + k


class RuntimePolar(torch.nn.Module):
    """The rotation built in ``forward`` from a position input: ``polar``, ``complex``,
    ``real`` / ``imag``, a complex ``cat`` along the pairs, ``unsqueeze``, ``permute``, a real
    scale of a complex tensor, a complex sum."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        angle = pos[:, :, None] * torch.arange(1, D // 2 + 1, dtype=x.dtype)  # (B, S, D/2)
        rot = torch.polar(torch.ones_like(angle), angle).unsqueeze(2)  # (B, S, 1, D/2)
        z = torch.complex(x[..., : D // 2], x[..., D // 2:])  # (B, S, H, D/2)
        w = torch.cat([z * rot, z * 0.5], dim=-1)  # (B, S, H, D)
        w = (w + z.repeat(1, 1, 1, 2)).permute(0, 2, 1, 3)  # (B, H, S, D)
        return torch.cat([w.real, w.imag], dim=-1)


def _check(module: torch.nn.Module, inputs: tuple, rtol: float = 1e-5) -> None:
    got = np.asarray(tvmfuse.compile(module, inputs, target="cpu").load()(*inputs))
    with torch.no_grad():
        want = module(*inputs).float().numpy()
    assert got.shape == want.shape
    err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert err <= rtol, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_meta_llama_rope(dtype):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, S, H, D, generator=g).to(dtype) for _ in range(2))
    _check(MetaRope().eval(), (q, k), 1e-6 if dtype == torch.float32 else 1e-3)


def test_meta_llama_rope_symbolic_length():
    """One library for every length up to the buffer's: the pairs keep the symbolic S."""
    module = MetaRope().eval()
    x = torch.randn(1, S, H, D)
    lib = tvmfuse.compile(module, (x, x), target="cpu", inputs=[f"xq:1xSx{H}x{D}", f"xk:1xSx{H}x{D}"],
                          dynamic={"S": (1, 2 * S)})
    run = lib.load()
    g = torch.Generator().manual_seed(0)
    for seq in (1, 17, 2 * S):
        q, k = (torch.randn(1, seq, H, D, generator=g) for _ in range(2))
        np.testing.assert_allclose(np.asarray(run(q, k)), module(q, k).numpy(), rtol=1e-6, atol=1e-6)


def test_polar_complex_cat_permute_real_imag():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, H, D, generator=g)
    pos = torch.rand(B, S, generator=g) * 50
    _check(RuntimePolar().eval(), (x, pos))


def test_the_callers_program_keeps_its_complex_buffer():
    """The rewrite works on a copy: the program passed in still has its complex buffer and runs."""
    from tvmfuse.frontend.torch_complex import lower_complex

    q = torch.randn(B, S, H, D)
    ep = torch.export.export(MetaRope().eval(), (q, q)).run_decompositions()
    lowered = lower_complex(ep, "MetaRope")
    assert ep.constants["freqs_cis"].is_complex()
    assert not lowered.constants["freqs_cis"].is_complex()
    assert lowered.constants["freqs_cis"].shape == (2 * S, D // 2, 2)
    targets = {str(n.target) for n in lowered.graph.nodes}
    assert not any("complex" in t or "view_as_real" in t for t in targets), targets
    torch.testing.assert_close(lowered.module()(q, q), ep.module()(q, q))


class _ComplexInput(torch.nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(z * 2)


class _Abs(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_complex(x).abs()


@pytest.mark.parametrize("module, inputs, words", [
    (_ComplexInput(), (torch.randn(3, 4, dtype=torch.complex64),), r"node 'z'.*a complex model input"),
    (_Abs(), (torch.randn(3, 4, 2),), r"node 'abs.*'.*an op on complex tensors"),
], ids=["complex_input", "abs"])
def test_what_is_not_rewritten_is_named(module, inputs, words):
    with pytest.raises(ModelError, match=words):
        tvmfuse.compile(module, inputs, target="cpu")


def test_llama4_text_model():
    """transformers' Llama 4 (complex RoPE from ``torch.polar``, MoE, q / k L2 norms): cpu logits
    equal torch's, and on sm90 (fp16) each layer keeps one attention kernel."""
    transformers = pytest.importorskip("transformers")
    from tests.test_llm_import_lm import Logits
    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        cfg = transformers.Llama4TextConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=1, no_rope_layers=[1, 1])
        return Logits(transformers.Llama4ForCausalLM(cfg).eval())

    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    _check(model(), (ids,))
    report = analyze(import_model(model().half(), (ids,)).mod, get_target("sm90"), "float16",
                     stock=False)
    names = [k["name"] for k in report["kernels"]]
    assert sum(n == "attention" for n in names) == 2, names
    assert not any(n.startswith("take") for n in names), names  # the pairs' parts are slices


def test_meta_llama_block():
    """A block as Meta's Llama reference code writes it (``models/meta_llama.py``: complex RoPE,
    hand-written GQA attention): the cpu build equals torch, and in fp16 on sm90 it is the six
    kernels of a Llama layer — QKV GEMM (norm statistics in it), the RoPE'd q / k / v pack, the
    wgmma flash attention, the output GEMM with the residual, the gate / up pair GEMM, the down
    GEMM with the residual."""
    from models.meta_llama import Block
    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(0))
    _check(block, (x,))
    report = analyze(import_model(block.half(), (x.half(),)).mod, get_target("sm90"), "float16",
                     stock=False)
    rules = [k.get("rule") for k in report["kernels"]]
    assert len(rules) == 6 and rules.count("flash_attention_sm90") == 1, report["kernels"]
    assert rules.count("elementwise") == 1, rules  # the RoPE pack, pairs and all


@pytest.mark.gpu
def test_gpu_meta_llama_block(tmp_path):
    """The fp16 block on sm90 against torch in float64 (H100, session 45: 3.0e-4, torch's own fp16
    3.1e-4)."""
    from models.meta_llama import Block
    from tests.cuda_tools import check_vs_float64

    torch.manual_seed(0)
    block = Block().eval().half()
    x = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(0)).half()
    check_vs_float64(block, (x,), "sm90", tmp_path, 2e-3)
