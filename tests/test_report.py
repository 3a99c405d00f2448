"""``tvmfuse report``: byte counts on worked examples, schema, plot, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tvm.script import ir as I
from tvm.script import relax as R

from tvmfuse.frontend import import_model
from tvmfuse.report import analyze, format_table, op_name, plot_roofline
from tvmfuse.targets import get_target

N, M = 64, 128
F32 = 4


@I.ir_module
class SeedExample:
    """Y = ReLU(W·X + b), W: (N, N), X: (N, M), b: (N, 1), Y: (N, M)."""

    @R.function
    def main(w: R.Tensor((64, 64), "float32"), x: R.Tensor((64, 128), "float32"),
             b: R.Tensor((64, 1), "float32")) -> R.Tensor((64, 128), "float32"):
        with R.dataflow():
            wx = R.matmul(w, x)
            z = R.add(wx, b)
            y = R.nn.relu(z)
            R.output(y)
        return y


@pytest.mark.parametrize("target", ["cpu", "sm90"])
def test_seed_example_six_round_trips_become_two(target):
    report = analyze(SeedExample, get_target(target))
    nm, weights = N * M * F32, (N * N + N) * F32
    # unfused: GEMM reads X writes WX, add reads+writes, ReLU reads+writes: 6 passes of N·M
    assert report["hbm_bytes_unfused"] == 6 * nm + weights
    # fused: read X, write Y
    assert report["hbm_bytes_fused"] == 2 * nm + weights
    assert report["unfused_kernel_count"] == 3 and report["fused_kernel_count"] == 1
    (kernel,) = report["kernels"]
    assert kernel["pattern"] == "gemm_epilogue" and kernel["ops"] == ["matmul", "add", "relu"]
    assert kernel["flops"] >= 2 * N * N * M


def test_schema_fields():
    report = analyze(SeedExample, get_target("sm90"))
    for key, typ in [("target", str), ("unfused_kernel_count", int), ("fused_kernel_count", int),
                     ("hbm_bytes_unfused", int), ("hbm_bytes_fused", int), ("kernels", list),
                     ("not_fused", list)]:
        assert isinstance(report[key], typ), key
    for k in report["kernels"]:
        assert {"name", "pattern", "ops", "flops", "bytes"} <= set(k)
        assert k["pattern"] in {"elementwise", "norm", "gemm_epilogue", "norm_gemm", "attention", "other"}
    json.dumps(report)
    assert "HBM bytes unfused" in format_table(report)


def test_op_names():
    assert op_name("tir_rsqrt3") == "rsqrt" and op_name("add12") == "add"
    assert op_name("layer_norm") == "layer_norm"


def test_decoder_layer_boundaries_have_reasons(tmp_path):
    from models import decoder_layer
    from tvmfuse.frontend import import_model

    module, example = decoder_layer.small()
    report = analyze(import_model(module, example).mod, get_target("sm90"))
    assert report["fused_kernel_count"] < report["unfused_kernel_count"]
    assert report["hbm_bytes_fused"] < report["hbm_bytes_unfused"]
    # both RMSNorms feed only Linears: their row statistics are computed by the (fp32 SIMT) GEMMs,
    # QKV's and each of the SwiGLU's gate and up (kept apart: the up GEMM's epilogue takes
    # silu(gate)·up, no kernel combines them)
    assert sum(k["pattern"] == "norm_gemm" and k["ops"][0] == "rms_norm_stats"
               for k in report["kernels"]) == 3
    assert report["not_fused"] and all(nf["reason"] for nf in report["not_fused"])
    # the O projection (+ residual) writes the rows whose statistics the gate/up GEMM computes
    # in-loop: the reason says so, not only "GEMM feeding a GEMM"
    into_stats = [nf for nf in report["not_fused"] if nf["ops"][1] == "rms_norm_stats"
                  and nf["ops"][0] != "rms_norm_stats"]
    assert into_stats and all("in-loop" in nf["reason"] for nf in into_stats), report["not_fused"]
    stock = report["stock_tvm_kernel_count"]
    assert stock is not None and report["fused_kernel_count"] < stock
    plot_roofline(report, str(tmp_path / "roof.png"))
    assert (tmp_path / "roof.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_json_and_plot(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    png = tmp_path / "r.png"
    res = subprocess.run([sys.executable, "-m", "tvmfuse.cli", "report", "models.mlp_block:small",
                          "--json", "--plot", str(png)], cwd=root, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["fused_kernel_count"] == len(report["kernels"]) == 2
    assert [k["pattern"] for k in report["kernels"]] == ["norm_gemm", "gemm_epilogue"]
    # the one boundary left (fc1 → fc2) keeps its reason after fc1 absorbed the statistics kernel
    assert [(b["kernels"], b["reason"].split(":")[0]) for b in report["not_fused"]] == [
        ([k["name"] for k in report["kernels"]], "GEMM feeding a GEMM")]
    assert png.stat().st_size > 10_000


def _decode_residual_linear():
    """y = x + h·Wᵀ at 8 tokens (a decode step's down projection), W a constant (1024, 11008)."""
    import numpy as np
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([8, 1024], "float16"))
    h = relax.Var("h", relax.TensorType([8, 11008], "float16"))
    w = relax.const(np.random.default_rng(0).standard_normal((1024, 11008)).astype("float16"))
    with bb.function("main", [x, h]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.add(x, relax.op.matmul(h, relax.op.permute_dims(w))))
        bb.emit_func_output(y)
    return bb.get()


def test_gemv_kernels_carry_their_config():
    """A small-M GEMM's kernel names the GEMV engine and config it was generated with (``tile``)."""
    report = analyze(_decode_residual_linear(), get_target("sm90"))
    (kernel,) = report["kernels"]
    assert kernel["rule"] == "gemv" and kernel["pattern"] == "gemv"
    assert kernel["tile"].startswith(("ring ", "mma ", "simt ")), kernel
    assert "tile" not in analyze(SeedExample, get_target("cpu"))["kernels"][0]  # none: left out


class _MaskPositions(torch.nn.Module):
    """OPT's positions from the attention mask (``cumsum``), then an embedding of them."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Embedding(64, 16)

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        positions = torch.cumsum(mask, dim=1) * mask - 1
        return self.pos(positions.clamp(min=0))


def test_kernels_with_sizes_of_their_own_are_sized_at_the_call():
    """TVM's generic sm90 cumsum kernel takes (m, n) buffers of its own symbols in a static
    model: the report sizes it by the tensors the call passes (it raised "the size of the
    symbolic dimension 'm' is unknown" for transformers' OPT and Gemma-2)."""
    mask = torch.ones(2, 32, dtype=torch.int64)
    report = analyze(import_model(_MaskPositions(), (mask,)).mod, get_target("sm90"), stock=False)
    (cumsum,) = [k for k in report["kernels"] if "cumsum" in k["name"]]
    assert cumsum["bytes"] >= 2 * 2 * 32 * 8, cumsum  # the int64 (2, 32) input and output


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_stock_count_with_a_dtype(dtype):
    """The stock launch count is given for ``--dtype float16`` too (TVM's ToMixedPrecision first,
    as a stock user would run it); it was dropped whenever a dtype was asked."""
    report = analyze(SeedExample, get_target("sm90"), dtype)
    assert isinstance(report["stock_tvm_kernel_count"], int) and report["stock_tvm_kernel_count"] >= 1


def test_renamed_gemm_kernels_keep_their_ops_and_flops():
    """sm90 GEMMs rebuilt to read a weight's (N, K) copy (``…_nt``: a cross-attention's q and kv
    projections) are reported with their fused ops and FLOPs, not as "other" with 0 FLOPs; the
    attention kernel's FLOPs are its own count (4·B·H·Sq·Skv·D), not TVM's loop estimate."""
    from torch import nn

    class Cross(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(256, 4, batch_first=True)

        def forward(self, x, mem):
            return self.mha(x, mem, mem, need_weights=False)[0] + x

    inputs = (torch.randn(2, 32, 256).half(), torch.randn(2, 64, 256).half())
    report = analyze(import_model(Cross().half().eval(), inputs).mod, get_target("sm90"), stock=False)
    kernels = report["kernels"]
    assert all(k["pattern"] != "other" for k in kernels), [(k["pattern"], k["ops"]) for k in kernels]
    gemms = [k for k in kernels if k["pattern"] == "gemm_epilogue"]
    # q-proj (64 rows × 256 × 256), kv-proj (128 × 512 × 256), out-proj (64 × 256 × 256)
    assert len(gemms) == 3 and all(k["flops"] >= 2 * 64 * 256 * 256 for k in gemms), gemms
    (attention,) = [k for k in kernels if k["pattern"] == "attention"]
    assert attention["flops"] == 4 * 2 * 4 * 32 * 64 * 64
