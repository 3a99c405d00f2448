"""PermuteRowsThroughGemm: batch/sequence swaps move through Linears (nn.MultiheadAttention).

Before/Expected for both sides (the output side's swap cancels with the attention result's, the
input side's moves into the attention operands' views), the cases left alone, numerics of each
rewrite on llvm, and end to end: torch's ``nn.MultiheadAttention`` and ``nn.TransformerEncoder``
(post- and pre-LN) in fp16 — fewer kernels for sm90, cpu output against float64 torch.
"""

from __future__ import annotations

import pytest
import torch
import tvm
from torch import nn
from tvm.script import ir as I
from tvm.script import relax as R

from tests.relax_util import apply_pass, assert_same_numerics
from tvmfuse.passes.permute_rows import PermuteRowsThroughGemm


@I.ir_module
class OutputSide:
    """MHA's end: attention (B, S, H, D) → (S, B, H, D) → out-proj → (S, B, E) → (B, S, E) + x."""

    @R.function
    def main(att: R.Tensor((2, 4, 2, 4), "float32"), w: R.Tensor((8, 8), "float32"),
             b: R.Tensor((8,), "float32"), x: R.Tensor((2, 4, 8), "float32")
             ) -> R.Tensor((2, 4, 8), "float32"):
        with R.dataflow():
            t = R.permute_dims(att, [1, 0, 2, 3])
            o = R.reshape(t, R.shape([8, 8]))
            m = R.matmul(o, w)
            c = R.add(m, b)
            r = R.reshape(c, R.shape([4, 2, 8]))
            y = R.permute_dims(r, [1, 0, 2])
            z = R.add(y, x)
            R.output(z)
        return z


@I.ir_module
class OutputSideExpected:
    @R.function
    def main(att: R.Tensor((2, 4, 2, 4), "float32"), w: R.Tensor((8, 8), "float32"),
             b: R.Tensor((8,), "float32"), x: R.Tensor((2, 4, 8), "float32")
             ) -> R.Tensor((2, 4, 8), "float32"):
        with R.dataflow():
            o = R.reshape(att, R.shape([8, 8]))
            m = R.matmul(o, w)
            c = R.add(m, b)
            y = R.reshape(c, R.shape([2, 4, 8]))
            z = R.add(y, x)
            R.output(z)
        return z


@I.ir_module
class InputSide:
    """MHA's start: (B, S, E) → (S, B, E) → in-proj → (S, B, 3, E) → q, k, v (B, S, H, D)."""

    @R.function
    def main(x: R.Tensor((2, 4, 8), "float32"), w: R.Tensor((8, 24), "float32")
             ) -> R.Tensor((2, 4, 2, 4), "float32"):
        with R.dataflow():
            t = R.permute_dims(x, [1, 0, 2])
            a = R.reshape(t, R.shape([8, 8]))
            m = R.matmul(a, w)
            g = R.nn.gelu(m)
            r = R.reshape(g, R.shape([4, 2, 3, 8]))
            q0 = R.take(r, R.const(0, "int64"), axis=2)
            k0 = R.take(r, R.const(1, "int64"), axis=2)
            v0 = R.take(r, R.const(2, "int64"), axis=2)
            q = R.permute_dims(R.reshape(q0, R.shape([4, 2, 2, 4])), [1, 0, 2, 3])
            k = R.permute_dims(R.reshape(k0, R.shape([4, 2, 2, 4])), [1, 0, 2, 3])
            v = R.permute_dims(R.reshape(v0, R.shape([4, 2, 2, 4])), [1, 0, 2, 3])
            o = R.nn.attention(q, k, v)
            R.output(o)
        return o


@I.ir_module
class InputSideExpected:
    @R.function
    def main(x: R.Tensor((2, 4, 8), "float32"), w: R.Tensor((8, 24), "float32")
             ) -> R.Tensor((2, 4, 2, 4), "float32"):
        with R.dataflow():
            a = R.reshape(x, R.shape([8, 8]))
            m = R.matmul(a, w)
            g = R.nn.gelu(m)
            r0 = R.reshape(g, R.shape([2, 4, 3, 8]))
            r = R.permute_dims(r0, [1, 0, 2, 3])
            q0 = R.take(r, R.const(0, "int64"), axis=2)
            k0 = R.take(r, R.const(1, "int64"), axis=2)
            v0 = R.take(r, R.const(2, "int64"), axis=2)
            q = R.permute_dims(R.reshape(q0, R.shape([4, 2, 2, 4])), [1, 0, 2, 3])
            k = R.permute_dims(R.reshape(k0, R.shape([4, 2, 2, 4])), [1, 0, 2, 3])
            v = R.permute_dims(R.reshape(v0, R.shape([4, 2, 2, 4])), [1, 0, 2, 3])
            o = R.nn.attention(q, k, v)
            R.output(o)
        return o


@I.ir_module
class SwapFeedsAnotherLinear:
    """The permuted Linear's result feeds a second Linear, not attention: moving the swap would
    only widen the copy (8 → 24 columns), so it stays."""

    @R.function
    def main(x: R.Tensor((2, 4, 8), "float32"), w: R.Tensor((8, 24), "float32"),
             w2: R.Tensor((24, 8), "float32")) -> R.Tensor((8, 8), "float32"):
        with R.dataflow():
            t = R.permute_dims(x, [1, 0, 2])
            a = R.reshape(t, R.shape([8, 8]))
            m = R.matmul(a, w)
            r = R.reshape(m, R.shape([4, 2, 24]))
            r2 = R.reshape(r, R.shape([8, 24]))
            y = R.matmul(r2, w2)
            R.output(y)
        return y


@I.ir_module
class SwapsDoNotCancel:
    """The out-projection reads a tensor whose own permutation does not undo the output's: stays."""

    @R.function
    def main(att: R.Tensor((2, 4, 2, 4), "float32"), w: R.Tensor((8, 8), "float32")
             ) -> R.Tensor((2, 4, 8), "float32"):
        with R.dataflow():
            t = R.permute_dims(att, [1, 0, 3, 2])
            o = R.reshape(t, R.shape([8, 8]))
            m = R.matmul(o, w)
            r = R.reshape(m, R.shape([4, 2, 8]))
            y = R.permute_dims(r, [1, 0, 2])
            R.output(y)
        return y


@I.ir_module
class ChainValueReadTwice:
    """The GEMM's output is read by the chain and by the function's other output: rows must keep
    their order for that reader, so nothing moves."""

    @R.function
    def main(att: R.Tensor((2, 4, 2, 4), "float32"), w: R.Tensor((8, 8), "float32")
             ) -> R.Tuple(R.Tensor((2, 4, 8), "float32"), R.Tensor((8, 8), "float32")):
        with R.dataflow():
            t = R.permute_dims(att, [1, 0, 2, 3])
            o = R.reshape(t, R.shape([8, 8]))
            m = R.matmul(o, w)
            r = R.reshape(m, R.shape([4, 2, 8]))
            y = R.permute_dims(r, [1, 0, 2])
            out = (y, m)
            R.output(out)
        return out


def _canonical(mod: tvm.IRModule) -> tvm.IRModule:
    return tvm.relax.transform.CanonicalizeBindings()(mod)


def test_output_side_swaps_cancel():
    after = apply_pass(PermuteRowsThroughGemm(), OutputSide)
    tvm.ir.assert_structural_equal(_canonical(after), OutputSideExpected)
    assert_same_numerics(OutputSide, after)


def test_input_side_swap_moves_into_the_attention_operands():
    after = apply_pass(PermuteRowsThroughGemm(), InputSide)
    tvm.ir.assert_structural_equal(_canonical(after), _canonical(InputSideExpected))
    assert_same_numerics(InputSide, after)


@pytest.mark.parametrize("mod", [SwapFeedsAnotherLinear, SwapsDoNotCancel, ChainValueReadTwice],
                         ids=["feeds_a_linear", "no_cancel", "read_twice"])
def test_left_alone(mod):
    after = apply_pass(PermuteRowsThroughGemm(), mod)
    tvm.ir.assert_structural_equal(after, mod)


class _MHA(nn.Module):
    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(256, 8, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False)[0] + x


def _encoder(norm_first: bool) -> nn.Module:
    layer = nn.TransformerEncoderLayer(256, 4, 512, dropout=0.1, batch_first=True,
                                       norm_first=norm_first, activation="gelu")
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


# (module, kernels on sm90 before this pass, with it): the swaps and the attention result's
# transpose go; pre-LN, each layer's first norm then folds into its QKV GEMM as well. torch's
# default, sequence first (x is (S, B, E) there), has no swaps to move: its attention writes the
# (S, B, H, D) result itself (FoldAttentionLayout's SBHD; 5 kernels before that)
MODULES = {"mha": (_MHA, 7, 4),
           "mha_sequence_first": (lambda: _MHA(batch_first=False), 4, 4),
           "encoder_post_ln": (lambda: _encoder(False), 22, 16),
           "encoder_pre_ln": (lambda: _encoder(True), 20, 12)}


@pytest.mark.parametrize("name", list(MODULES))
def test_torch_modules_as_users_write_them(name):
    """fp16 modules as written with torch.nn: the sm90 kernel count drops, the output of the
    cpu build equals float64 torch's (the cpu pipeline runs the same pass)."""
    import numpy as np

    import tvmfuse
    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    make, _before, kernels = MODULES[name]
    torch.manual_seed(0)
    module = make().half().eval()
    x = torch.randn(2, 64, 256).half()
    report = analyze(import_model(module, (x,)).mod, get_target("sm90"), stock=False)
    assert report["fused_kernel_count"] == kernels, [k["ops"] for k in report["kernels"]]
    assert sum(k["pattern"] == "attention" for k in report["kernels"]) == (1 if name.startswith("mha") else 2)
    lib = tvmfuse.compile(module, (x,), target="cpu")
    out = lib.load(device="cpu")(x)
    with torch.no_grad():
        ref = module.double()(x.double())
    err = float((out.double() - ref).norm() / ref.norm())
    assert np.isfinite(err) and err < 5e-3, err


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
@pytest.mark.parametrize("name", ["mha", "mha_sequence_first", "encoder_pre_ln"])
def test_onnx_export_compiles_like_torch_export(name, dynamo, tmp_path):
    """The ONNX export of the same fp32 module, both exporters: as many sm90 kernels as the
    torch.export of it (the Gathers picking q, k, v take constant indices since the converter
    wraps them at import; before, the input swap kept a kernel: MHA 5, pre-LN encoder 16)."""
    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    make, _before, _kernels = MODULES[name]
    torch.manual_seed(0)
    module = make().eval()
    x = torch.randn(2, 64, 256)
    path = tmp_path / "m.onnx"
    torch.onnx.export(module, (x,), str(path), dynamo=dynamo, opset_version=18)
    counts = [analyze(import_model(*m).mod, get_target("sm90"), stock=False)["fused_kernel_count"]
              for m in ((str(path),), (module, (x,)))]
    assert counts[0] == counts[1], counts


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODULES))
def test_gpu_torch_modules_vs_float64(name, tmp_path):
    """H200: the same fp16 modules compiled for sm90 (head dim 64 in the encoders: the wgmma
    flash kernel; 32 in the MHA: the sm80 one) against float64 torch."""
    from tests.cuda_tools import check_vs_float64

    make, _before, _kernels = MODULES[name]
    torch.manual_seed(0)
    module = make().half().eval()
    check_vs_float64(module, (torch.randn(2, 64, 256).half(),), "sm90", tmp_path, 1e-2)
