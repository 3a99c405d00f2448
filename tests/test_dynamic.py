"""Symbolic lengths end to end: one library for every ``S`` in ``--dynamic S=LO..HI``.

A Llama-style LM (models/llama_lm.py at tiny size: RMSNorm, fused QKV, RoPE tables sliced to ``S``,
GQA, causal SDPA, SwiGLU MLP) is compiled once with ``ids: 1xS`` for the cpu target and called at
three lengths against torch; the same from its ONNX export with a ``dim_param``; the CLI flags; the
runtime's range and consistency checks (InputError); the report; and the sm90 build through nvcc.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tvmfuse
from models import llama_lm, mlp_block
from tests.cuda_tools import needs_nvcc
from tvmfuse.cli import main as cli
from tvmfuse.errors import InputError

RTOL = 1e-4
LENGTHS = (1, 7, 33)
TINY = {"vocab": 128, "hidden": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn": 96, "seq": 64}


def tiny_lm() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """The factory the CLI tests name: fp32, RoPE tables of 64 rows, example of 8 tokens."""
    module, (ids,) = llama_lm.build(**TINY, dtype=torch.float32)
    return module, (ids[:, :8],)


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def lm_lib():
    module, example = tiny_lm()
    lib = tvmfuse.compile(module, example, target="cpu", inputs={"ids": "1xS"}, dynamic={"S": (1, 64)})
    return module, lib


def test_torch_lm_one_library_three_lengths(lm_lib):
    module, lib = lm_lib
    assert lib.metadata["inputs"] == [{"name": "ids", "shape": [1, "S"], "dtype": "int64"}]
    assert lib.metadata["dynamic"] == {"S": [1, 64]}
    assert lib.outputs[0].shape == (1, "S", TINY["vocab"])
    run = lib.load()
    ids = torch.randint(0, TINY["vocab"], (1, 64), generator=torch.Generator().manual_seed(1))
    for n in LENGTHS:
        with torch.no_grad():
            ref = module(ids[:, :n])
        out = run(ids[:, :n])
        assert out.shape == (1, n, TINY["vocab"])
        assert _rel_err(out, ref) <= RTOL, n


def test_out_of_range_call_is_an_input_error(lm_lib):
    run = lm_lib[1].load()
    with pytest.raises(InputError, match=r"input 0 'ids': dim 1 \(S\) is 65, outside S's range 1\.\.64"):
        run(torch.zeros(1, 65, dtype=torch.int64))
    with pytest.raises(InputError, match=r"expected shape \[1, 'S'\], got \[2, 4\]"):
        run(np.zeros((2, 4), np.int64))


class AddMatmul(torch.nn.Module):
    """``(x + y) @ w``: both inputs carry S."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y) @ self.w


def test_inconsistent_symbol_across_inputs_is_an_input_error():
    x = torch.randn(1, 5, 16)
    module = AddMatmul()
    lib = tvmfuse.compile(module, (x, torch.randn(1, 5, 16)), target="cpu",
                          inputs={"x": "1xSx16", "y": "1xSx16"}, dynamic={"S": (1, 32)})
    run = lib.load()
    a, b = torch.randn(1, 9, 16), torch.randn(1, 9, 16)
    assert _rel_err(run(a, b), module(a, b).detach()) <= RTOL
    with pytest.raises(InputError, match=r"input 1 'y': dim 1 \(S\) is 4, but input 0 'x' has S = 9"):
        run(a, torch.randn(1, 4, 16))


def test_onnx_dim_param_one_library_three_lengths(tmp_path):
    """The MLP block (LayerNorm, Linear + GELU, Linear, residual) exported with a ``seq`` dim_param.

    (The LM's legacy ONNX export does not import with symbolic ``seq``: TVM's ``Tile`` converter
    needs a static shape for ``repeat_interleave``.)"""
    module, (x,) = mlp_block.build(batch=1, seq=8, hidden=32)
    module = module.float()
    path = tmp_path / "mlp.onnx"
    torch.onnx.export(module, (x.float(),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {1: "seq"}, "y": {1: "seq"}}, dynamo=False)
    lib = tvmfuse.compile(str(path), target="cpu", dynamic={"seq": (1, 64)})
    assert lib.metadata["inputs"][0]["shape"] == [1, "seq", 32]
    run = lib.load()
    rng = np.random.default_rng(0)
    for n in LENGTHS:
        xs = rng.standard_normal((1, n, 32)).astype(np.float32)
        (ref,) = lib.model.reference(xs)
        assert _rel_err(run(xs), ref) <= RTOL, n


def test_cli_compile_run_and_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dyn_factory.py").write_text("from tests.test_dynamic import tiny_lm\n")
    runner = CliRunner()
    lib = tmp_path / "lm.so"
    res = runner.invoke(cli, ["compile", "dyn_factory:tiny_lm", "--target", "cpu", "-o", str(lib),
                              "--input", "ids:1xS", "--dynamic", "S=1..64"])
    assert res.exit_code == 0, res.output
    assert "dynamic: S=1..64" in res.output and "ids:int64[1, 'S']" in res.output
    for n in (3, 20):
        np.savez(tmp_path / "in.npz", ids=np.arange(n, dtype=np.int64)[None])
        res = runner.invoke(cli, ["run", str(lib), "--inputs", str(tmp_path / "in.npz")])
        assert res.exit_code == 0, res.output
        assert f"output0: float32[1, {n}, {TINY['vocab']}]" in res.output
    res = runner.invoke(cli, ["report", "dyn_factory:tiny_lm", "--target", "cpu", "--json",
                              "--input", "ids:1xS", "--dynamic", "S=1..64"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output[res.output.index("{"):])
    assert report["sizes"] == {"S": 64}
    assert report["fused_kernel_count"] == len(report["kernels"]) > 0
    assert report["hbm_bytes_fused"] > 0
    res = runner.invoke(cli, ["compile", "dyn_factory:tiny_lm", "--target", "cpu", "-o", str(lib),
                              "--input", "ids:1xS"])
    assert res.exit_code == 1 and "--dynamic S=LO..HI" in res.output


@needs_nvcc
def test_sm90_symbolic_build_compiles_with_nvcc(tmp_path):
    """fp16 LM with S symbolic for sm90: lowers, generates CUDA, and nvcc builds the fatbin."""
    module, (ids,) = llama_lm.build(**TINY)
    lib = tvmfuse.compile(module, (ids[:, :8],), target="sm90", inputs={"ids": "1xS"},
                          dynamic={"S": (1, 64)})
    path = lib.export(tmp_path / "lm.so")
    assert path.stat().st_size > 0
    assert tvmfuse.runtime.read_metadata(path)["dynamic"] == {"S": [1, 64]}


def test_symbolic_lm_fuses_its_norms_residuals_and_swiglu():
    """With S symbolic the pattern passes fire as on static shapes (they compare symbolic dims
    structurally; only the normalised / GEMM K and N axes must be static): per layer both RMSNorms
    fold into their GEMMs (a statistics kernel each), the residual adds into the O and down GEMMs,
    gate/up is one pair GEMM with the SwiGLU epilogue; no power / mean kernel is left."""
    from tvmfuse.frontend import dynamic_ranges, import_model, input_overrides
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    module, example = tiny_lm()
    imported = import_model(module, example, input_overrides({"ids": "1xS"}),
                            dynamic_ranges({"S": (1, 64)}))
    kernels = analyze(imported.mod, get_target("cpu"))["kernels"]
    ops = [k["ops"] for k in kernels]
    layers = TINY["n_layers"]
    assert sum(o == ["rms_norm_stats"] for o in ops) == 2 * layers + 1, ops
    assert sum(o[0] == "matmul" and o[-1] == "add" for o in ops) == 2 * layers, ops
    assert sum(o[0] == "matmul" and "strided_slice" in o and "sigmoid" in o for o in ops) == layers
    assert not any({"power", "mean"} & set(o) for o in ops), ops


def test_transformers_llama_with_a_symbolic_length_reports_on_sm90():
    """transformers' LlamaForCausalLM (random init, fp16) with ``--dynamic``: its RoPE slices
    ``[..., -1]``-axis in-bounds slices legalise, a symbol passed by value to a kernel is no row
    statistic, kernels naming the symbol their own way are sized; every projection GEMM is the
    sm_90a wgmma kernel with its row buckets (only attention's fp32 batched products fall back)."""
    transformers = pytest.importorskip("transformers")
    from tvmfuse.frontend import dynamic_ranges, import_model, input_overrides
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().half()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    imported = import_model(Logits(), (torch.randint(0, 256, (1, 16)),), input_overrides({"ids": "1xS"}),
                            dynamic_ranges({"S": (1, 512)}))
    kernels = analyze(imported.mod, get_target("sm90"))["kernels"]
    projections = [k for k in kernels if "matmul" in k["name"] and "float32" not in k.get("fallback", "")]
    assert projections and all(k.get("rule") == "gemm_sm90" for k in projections), projections
