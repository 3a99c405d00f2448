"""FoldAttentionLayout: attention on (B, H, S, D) tensors reads and writes them in place.

IR: the transposes around ``R.nn.attention`` become the kernel's layout (Before / Expected, the
kernel being the cpu generator's for the spec written out here); operands computed by injective
ops keep the pack; an output read twice keeps its transpose. Numerics: the rewritten module
against a freshly built Before on the llvm target, and plain fp16 torch modules (SDPA and the
hand-written form in (B, H, S, D), inputs in (B, S, H, D), causal or not, GQA) compiled for the
cpu target against torch in float64. Kernel counts: one kernel for each of those forms on sm90
(the report's count), the sm_90a flash kernel reading the untransposed tensors. GPU
(``@pytest.mark.gpu``): the same forms through compile → export → load on sm90 and sm80 against
torch in float64, with the attention kernel that ran checked in the SASS.
"""

from __future__ import annotations

import pytest
import torch
import tvm
from relax_util import apply_pass, assert_same_numerics
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tests import attention_forms as forms
from tests.test_pass_attention_forms import _check_numerics, _compile, _run
from tvmfuse.kernels.attention.spec import AttentionSpec
from tvmfuse.passes import PackAttentionInputs
from tvmfuse.passes.attention_layout import FoldAttentionLayout
from tvmfuse.rules.attention import attention_primfunc

SCALE = 0.25  # 1 / sqrt(16)


@I.ir_module
class Before:
    @R.function
    def main(q: R.Tensor((1, 4, 8, 16), "float32"), k: R.Tensor((1, 2, 8, 16), "float32"),
             v: R.Tensor((1, 2, 8, 16), "float32")) -> R.Tensor((1, 4, 8, 16), "float32"):
        with R.dataflow():
            qt = R.permute_dims(q, axes=[0, 2, 1, 3])
            kt = R.permute_dims(k, axes=[0, 2, 1, 3])
            vt = R.permute_dims(v, axes=[0, 2, 1, 3])
            o = R.nn.attention(qt, kt, vt, causal_mask="TopLeft")
            out = R.permute_dims(o, axes=[0, 2, 1, 3])
            R.output(out)
        return out


@I.ir_module
class Expected:
    @T.prim_func
    def attention(q: T.Buffer((1, 4, 8, 16), "float32"), k: T.Buffer((1, 2, 8, 16), "float32"),
                  v: T.Buffer((1, 2, 8, 16), "float32"), out: T.Buffer((1, 4, 8, 16), "float32")):
        T.evaluate(0)  # replaced by the generator's kernel for SPEC below

    @R.function
    def main(q: R.Tensor((1, 4, 8, 16), "float32"), k: R.Tensor((1, 2, 8, 16), "float32"),
             v: R.Tensor((1, 2, 8, 16), "float32")) -> R.Tensor((1, 4, 8, 16), "float32"):
        cls = Expected
        with R.dataflow():
            out = R.call_tir(cls.attention, (q, k, v), out_ty=R.Tensor((1, 4, 8, 16), "float32"))
            R.output(out)
        return out


SPEC = AttentionSpec(batch=1, q_len=8, kv_len=8, q_heads=4, kv_heads=2, head_dim=16,
                     dtype="float32", scale=SCALE, causal="TopLeft", out_dtype="float32",
                     qkv_layout="BHSD", out_layout="BHSD")


def _with_kernel(mod: tvm.IRModule, spec: AttentionSpec) -> tvm.IRModule:
    mod = mod.clone()
    # the kernel as the rules return it (attention_primfunc adds the report's FLOPs attribute)
    mod.update_func(mod.get_global_var("attention"),
                    attention_primfunc(spec, tvm.target.Target("llvm")).without_attr("global_symbol"))
    return mod


@I.ir_module
class RopeOperands:
    """q and k computed in (B, H, S, D) by an elementwise op: the pack writes all three operands."""

    @R.function
    def main(q: R.Tensor((1, 4, 8, 16), "float32"), k: R.Tensor((1, 4, 8, 16), "float32"),
             v: R.Tensor((1, 4, 8, 16), "float32"), c: R.Tensor((8, 16), "float32")
             ) -> R.Tensor((1, 4, 8, 16), "float32"):
        with R.dataflow():
            qr = R.multiply(q, c)
            kr = R.multiply(k, c)
            qt = R.permute_dims(qr, axes=[0, 2, 1, 3])
            kt = R.permute_dims(kr, axes=[0, 2, 1, 3])
            vt = R.permute_dims(v, axes=[0, 2, 1, 3])
            o = R.nn.attention(qt, kt, vt)
            out = R.permute_dims(o, axes=[0, 2, 1, 3])
            R.output(out)
        return out


@I.ir_module
class OutputReadTwice:
    """Inputs fold; the result is also read in (B, S, H, D), so its transpose stays."""

    @R.function
    def main(q: R.Tensor((1, 4, 8, 16), "float32"), k: R.Tensor((1, 4, 8, 16), "float32"),
             v: R.Tensor((1, 4, 8, 16), "float32")) -> R.Tensor((1, 4, 8, 16), "float32"):
        with R.dataflow():
            qt = R.permute_dims(q, axes=[0, 2, 1, 3])
            kt = R.permute_dims(k, axes=[0, 2, 1, 3])
            vt = R.permute_dims(v, axes=[0, 2, 1, 3])
            o = R.nn.attention(qt, kt, vt)
            out = R.permute_dims(o, axes=[0, 2, 1, 3])
            total = R.sum(o)
            gv = R.add(out, total)
            R.output(gv)
        return gv


@I.ir_module
class BshdInOut:
    """Plain (B, S, H, D) operands and result: nothing to fold."""

    @R.function
    def main(q: R.Tensor((1, 8, 4, 16), "float32"), k: R.Tensor((1, 8, 4, 16), "float32"),
             v: R.Tensor((1, 8, 4, 16), "float32")) -> R.Tensor((1, 8, 4, 16), "float32"):
        with R.dataflow():
            o = R.nn.attention(q, k, v, causal_mask="TopLeft")
            R.output(o)
        return o


def _kernel_calls(mod: tvm.IRModule) -> list[relax.Call]:
    call_tir = tvm.ir.Op.get("relax.call_tir")
    return [b.value for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and b.value.op.same_as(call_tir)]


def _ops(mod: tvm.IRModule) -> list[str]:
    return [b.value.op.name for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def test_transposes_fold_into_the_kernel():
    tvm.ir.assert_structural_equal(apply_pass(FoldAttentionLayout(), Before),
                                   _with_kernel(Expected, SPEC))


def test_folded_numerics():
    assert_same_numerics(Before, apply_pass(FoldAttentionLayout(), Before))


def test_computed_operands_keep_the_pack():
    after = apply_pass(FoldAttentionLayout(), RopeOperands)
    tvm.ir.assert_structural_equal(after, RopeOperands)
    assert "relax.concat" in _ops(PackAttentionInputs()(after))  # the pack still writes them


def test_output_read_twice_keeps_its_transpose():
    after = apply_pass(FoldAttentionLayout(), OutputReadTwice)
    (call,) = _kernel_calls(after)
    assert [a.name for a in call.args[1].fields] == ["q", "k", "v"]
    kernel = after[call.args[0]]
    assert [tuple(int(d) for d in p.shape) for p in kernel.params] == [
        (1, 4, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16), (1, 8, 4, 16)]  # q, k, v BHSD; out BSHD
    assert _ops(after).count("relax.permute_dims") == 1
    assert_same_numerics(OutputReadTwice, after)


def test_plain_bshd_left_to_the_legalisation():
    tvm.ir.assert_structural_equal(apply_pass(FoldAttentionLayout(), BshdInOut), BshdInOut)


def test_bias_and_bottom_right_numerics():
    """A padding bias (not transposed) beside folded operands, Sq < Skv with a BottomRight mask."""

    @I.ir_module
    class WithBias:
        @R.function
        def main(q: R.Tensor((2, 4, 5, 16), "float32"), k: R.Tensor((2, 2, 9, 16), "float32"),
                 v: R.Tensor((2, 2, 9, 16), "float32"), bias: R.Tensor((2, 1, 1, 9), "float32")
                 ) -> R.Tensor((2, 4, 5, 16), "float32"):
            with R.dataflow():
                qt = R.permute_dims(q, axes=[0, 2, 1, 3])
                kt = R.permute_dims(k, axes=[0, 2, 1, 3])
                vt = R.permute_dims(v, axes=[0, 2, 1, 3])
                o = R.nn.attention(qt, kt, vt, bias, causal_mask="BottomRight")
                out = R.permute_dims(o, axes=[0, 2, 1, 3])
                R.output(out)
            return out

    after = apply_pass(FoldAttentionLayout(), WithBias)
    assert "relax.permute_dims" not in _ops(after) and len(_kernel_calls(after)) == 1
    assert_same_numerics(WithBias, after)


# --------------------------------------------------------------------------------------------
# Torch modules as users write them (tests/attention_forms.py), plus SDPA without a mask


class SdpaFull(torch.nn.Module):
    """``F.scaled_dot_product_attention`` on (B, H, S, D) inputs, no mask."""

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


class SdpaBshd(torch.nn.Module):
    """(B, S, H, D) inputs transposed into SDPA (causal), the result transposed back."""

    def forward(self, q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2)


def _build(name: str, head_dim: int = forms.D, dtype=torch.float16):
    """``(module, inputs)``: a form of tests/attention_forms.py, or one of the two SDPA modules
    above (inputs (B, H, S, D) for ``sdpa_full``, (B, S, H, D) for ``sdpa_bshd``)."""
    if name in forms.FORMS:
        return forms.build(name, dtype=dtype, head_dim=head_dim)
    g = torch.Generator().manual_seed(0)
    shape = (forms.B, forms.H, forms.S, head_dim)
    if name == "sdpa_bshd":
        shape = (forms.B, forms.S, forms.H, head_dim)
    module = {"sdpa_full": SdpaFull, "sdpa_bshd": SdpaBshd}[name]()
    return module, tuple(torch.randn(*shape, generator=g).to(dtype) for _ in range(3))


# form → (qkv_layout, out_layout) the kernel gets
LAYOUT_FORMS = {
    "sdpa_is_causal": ("BHSD", "BHSD"),
    "sdpa_full": ("BHSD", "BHSD"),
    "hand_written": ("BHSD", "BHSD"),
    "sdpa_enable_gqa": ("BHSD", "BHSD"),
    "gqa_repeat_interleave": ("BHSD", "BHSD"),
    "bshd_inputs": ("BSHD", "BSHD"),
    "sdpa_bshd": ("BSHD", "BSHD"),
}


def _attention_kernels(mod: tvm.IRModule) -> list[tvm.tirx.PrimFunc]:
    return [f for gv, f in mod.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint.startswith("attention")]


def _layouts(kernel: tvm.tirx.PrimFunc, spec_shape: tuple) -> tuple[str, str]:
    """(qkv, out) layout of a kernel from its q and out buffer shapes ((B, S, H, D) given)."""
    b, s, h, d = spec_shape

    def layout(param):
        shape = tuple(int(x) for x in param.shape)
        return {(b, s, h, d): "BSHD", (b, h, s, d): "BHSD"}[shape]

    return layout(kernel.params[0]), layout(kernel.params[-1])


@pytest.mark.parametrize("name", list(LAYOUT_FORMS))
def test_form_cpu_numerics_and_layout(name: str):
    """cpu target: one attention kernel in the expected layouts, no transpose or pack kernel,
    output against torch in float64."""
    module, inputs = _build(name)
    lowered, stages, executable = _compile(module, inputs)
    (kernel,) = _attention_kernels(stages["fuse_tir"])
    assert _layouts(kernel, (forms.B, forms.S, forms.H, forms.D)) == LAYOUT_FORMS[name]
    names = [gv.name_hint for gv, f in stages["fuse_tir"].functions.items()
             if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(names) == 1, names  # the attention kernel alone: no pack, no transpose
    _check_numerics(module, inputs, _run(executable, inputs), torch.float16)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", ["sdpa_is_causal", "hand_written", "sdpa_enable_gqa", "sdpa_bshd"])
def test_form_one_kernel_on_sm90(name: str, head_dim: int):
    """sm90: the report's one kernel is the sm_90a flash kernel reading the inputs in place."""
    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    module, inputs = _build(name, head_dim=head_dim)
    rep = analyze(import_model(module, inputs).mod, get_target("sm90"), stock=False)
    assert rep["fused_kernel_count"] == 1, [k["name"] for k in rep["kernels"]]
    _, stages, _ = _compile(module, inputs, target="sm90")
    (kernel,) = _attention_kernels(stages["fuse_tir"])
    assert str(kernel.attrs["tvmfuse.rule"]) == "flash_attention_sm90"
    assert _layouts(kernel, (forms.B, forms.S, forms.H, head_dim)) == LAYOUT_FORMS[name]


# --------------------------------------------------------------------------------------------
# GPU: compile → export → load, against torch in float64; the attention kernel checked in SASS

GPU_FORMS = ["sdpa_is_causal", "sdpa_full", "hand_written", "sdpa_enable_gqa",
             "gqa_repeat_interleave", "sdpa_bshd"]


@pytest.mark.gpu
@pytest.mark.parametrize("target,head_dim", [("sm90", 128), ("sm90", 64), ("sm80", 128)])
@pytest.mark.parametrize("name", GPU_FORMS)
def test_form_gpu_matches_torch(name: str, target: str, head_dim: int, tmp_path):
    from tests.cuda_tools import assert_attention_kernel, check_vs_float64

    if target == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a kernels need a Hopper (9.0) GPU")
    module, inputs = _build(name, head_dim=head_dim)
    check_vs_float64(module, inputs, target, tmp_path, tol=5e-3)
    assert_attention_kernel(tmp_path / "m.so", "wgmma" if target == "sm90" else "mma_sync")


@I.ir_module
class SeqFirstOut:
    """(B, S, H, D) operands; the result read sequence first (torch MHA, ``batch_first=False``)."""

    @R.function
    def main(q: R.Tensor((2, 8, 4, 16), "float32"), k: R.Tensor((2, 8, 2, 16), "float32"),
             v: R.Tensor((2, 8, 2, 16), "float32")) -> R.Tensor((8, 2, 4, 16), "float32"):
        with R.dataflow():
            o = R.nn.attention(q, k, v, causal_mask="TopLeft")
            out = R.permute_dims(o, axes=[1, 0, 2, 3])
            R.output(out)
        return out


@I.ir_module
class SeqFirstOutExpected:
    @T.prim_func
    def attention(q: T.Buffer((2, 8, 4, 16), "float32"), k: T.Buffer((2, 8, 2, 16), "float32"),
                  v: T.Buffer((2, 8, 2, 16), "float32"), out: T.Buffer((8, 2, 4, 16), "float32")):
        T.evaluate(0)  # replaced by the generator's kernel for SEQ_FIRST_SPEC below

    @R.function
    def main(q: R.Tensor((2, 8, 4, 16), "float32"), k: R.Tensor((2, 8, 2, 16), "float32"),
             v: R.Tensor((2, 8, 2, 16), "float32")) -> R.Tensor((8, 2, 4, 16), "float32"):
        cls = SeqFirstOutExpected
        with R.dataflow():
            out = R.call_tir(cls.attention, (q, k, v), out_ty=R.Tensor((8, 2, 4, 16), "float32"))
            R.output(out)
        return out


SEQ_FIRST_SPEC = AttentionSpec(batch=2, q_len=8, kv_len=8, q_heads=4, kv_heads=2, head_dim=16,
                               dtype="float32", scale=SCALE, causal="TopLeft", out_dtype="float32",
                               qkv_layout="BSHD", out_layout="SBHD")


def test_sequence_first_result_folds_into_the_kernel():
    after = apply_pass(FoldAttentionLayout(), SeqFirstOut)
    tvm.ir.assert_structural_equal(after, _with_kernel(SeqFirstOutExpected, SEQ_FIRST_SPEC))
    assert_same_numerics(SeqFirstOut, after)


def test_packed_operands_then_the_result_folds():
    """The second run (after PackAttentionInputs): the packed call's operands are views, its
    (B, H, S, D) result is written by the kernel; no permute is left."""
    packed = PackAttentionInputs()(apply_pass(FoldAttentionLayout(), RopeOperands))
    assert _ops(packed).count("relax.permute_dims") == 4  # q, k, v and the result
    after = apply_pass(FoldAttentionLayout(), packed)
    (call,) = _kernel_calls(after)
    kernel = after[call.args[0]]
    assert tuple(int(d) for d in kernel.params[-1].shape) == (1, 4, 8, 16)  # out BHSD
    assert "global_symbol" not in kernel.attrs  # named "attention" for the report
    assert _ops(after).count("relax.permute_dims") == 3  # only the operands' (in the pack)
    assert_same_numerics(RopeOperands, after)
