"""NormGemmPrologue: norm → Linear becomes row statistics + a GEMM with a norm epilogue."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tests.relax_util import assert_same_numerics
from tvmfuse.passes import NormGemmPrologue


def _build(norm: str, residual: bool, n_linear: int = 1, rows=8) -> tvm.IRModule:
    """x (rows, 32) → norm → n_linear × matmul(·, W_i (32, 16)) [+ the normed tensor as residual]."""
    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, 32), "float32"))
    g = relax.const(rng.standard_normal(32).astype("float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            if norm == "rms":
                normed = bb.emit(relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5))
            else:
                b = relax.const(rng.standard_normal(32).astype("float32"))
                normed = bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5))
            outs = [bb.emit(relax.op.matmul(normed, relax.const(
                rng.standard_normal((32, 16)).astype("float32")))) for _ in range(n_linear)]
            if residual:
                outs.append(bb.emit(relax.op.add(normed, normed)))
            out = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else outs[0])
        bb.emit_func_output(out)
    return bb.get()


def _names(mod: tvm.IRModule) -> set[str]:
    return {gv.name_hint for gv in mod.functions}


@pytest.mark.parametrize("norm, stats", [("rms", "rms_norm_stats"), ("layer", "layer_norm_stats")])
def test_norm_becomes_stats_and_epilogue(norm, stats):
    before = _build(norm, residual=False)
    after = NormGemmPrologue()(before)
    script = after.script()
    assert "R.nn.rms_norm" not in script and "R.nn.layer_norm" not in script
    assert stats in _names(after)
    assert_same_numerics(before, after, rtol=1e-5)


def test_symbolic_rows_fold_too():
    """x (S, 32) with S symbolic (``--dynamic``): the normalised axis is static, so it folds."""
    rows = tvm.tirx.Var("S", "int64")
    qkv = NormGemmPrologue()(_build("rms", residual=False, n_linear=3, rows=rows))
    assert "R.nn.rms_norm" not in qkv.script()
    assert qkv["main"].script().count("rms_norm_stats") == 1
    before = _build("layer", residual=False, rows=rows)
    after = NormGemmPrologue()(before)
    assert "R.nn.layer_norm" not in after.script() and "layer_norm_stats" in _names(after)
    assert_same_numerics(before, after, rtol=1e-5)


def test_qkv_share_one_statistics_kernel():
    after = NormGemmPrologue()(_build("rms", residual=False, n_linear=3))
    assert after["main"].script().count("rms_norm_stats") == 1


def test_norm_needed_elsewhere_is_left_alone():
    before = _build("rms", residual=True)
    tvm.ir.assert_structural_equal(NormGemmPrologue()(before), before)


def test_cuda_target_folds_both_norms():
    """LayerNorm's stats kernel has a GPU rule (schedules/row_stats.py): on CUDA, LayerNorm and
    RMSNorm both become statistics + GEMM epilogue, exactly as on the CPU."""
    import torch

    from tvmfuse.frontend import import_model
    from tvmfuse.passes import FuseDecomposedNorms
    from tvmfuse.targets import get_target

    class LnLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.lin = torch.nn.LayerNorm(32), torch.nn.Linear(32, 16)
            self.rms, self.lin2 = torch.nn.RMSNorm(16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.lin2(self.rms(self.lin(self.ln(x))))

    mod = import_model(LnLinear().eval(), (torch.randn(4, 32),)).mod
    mod = FuseDecomposedNorms()(mod)
    with get_target("sm90").tvm_target():
        cuda = NormGemmPrologue()(mod)
    cpu = NormGemmPrologue()(mod)
    script = cuda.script()
    assert "R.nn.layer_norm" not in script and "R.nn.rms_norm" not in script
    assert {"layer_norm_stats", "rms_norm_stats"} <= _names(cuda)
    tvm.ir.assert_structural_equal(cuda, cpu)


def test_norm_through_two_reshapes_folds():
    """``layer_norm(x) → reshape (identity) → reshape (2-D) → matmul``, as the legacy ONNX exporter
    writes GPTBigCode's last norm before the LM head: it folds like one reshape (was a kernel of
    its own)."""
    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 32), "float32"))
    g, b = (relax.const(rng.standard_normal(32).astype("float32")) for _ in range(2))
    w = relax.const(rng.standard_normal((32, 16)).astype("float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            normed = bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5))
            same = bb.emit(relax.op.reshape(normed, (1, 8, 32)))
            flat = bb.emit(relax.op.reshape(same, (8, 32)))
            out = bb.emit_output(relax.op.matmul(flat, w))
        bb.emit_func_output(out)
    before = bb.get()
    after = NormGemmPrologue()(before)
    assert "R.nn.layer_norm" not in after.script() and "layer_norm_stats" in _names(after)
    assert_same_numerics(before, after, rtol=1e-5)


@pytest.mark.parametrize("centered", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_statistics_function_is_recognised(eps, centered):
    """The rules that move statistics into a GEMM read (eps, centered) back off this pass's
    PrimFunc. With eps 0 (a norm whose exporter dropped ``+ eps``: Helium's dynamo ONNX) TE folds
    the add away; the statistics stayed two kernels beside the GEMM (Helium 24 kernels, 14 with
    this)."""
    from tvmfuse.passes.norm_gemm import row_stats_params, stats_function

    func = stats_function(relax.TensorType([8, 64], "float16"), eps, centered)
    assert row_stats_params(func) == (eps, centered)
