"""FuseAttention on attention as users write it (the modules in tests/attention_forms.py).

Each form is a plain fp16 torch module, imported the way ``tvmfuse compile`` does (torch.export, or
the ONNX file of either exporter) and compiled for the cpu target. Checked per form: exactly one
``R.nn.attention`` after ``fuse_attention`` with a "fused" decision, no (S, S) tensor allocated
after ``finalize``, and the output against the module run by torch in float64 (fp16 tolerance;
torch's own fp16 error printed beside it). A sliding-window band (every spelling of
``forms.WINDOW_FORMS``) becomes one ``R.nn.attention`` with ``window_size`` (on CUDA targets unless
``Options(gpu_window_attention=False)``); what cannot be proved
stays unfused with its reason, and still computes the right numbers.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from tests import attention_forms as forms
from tvmfuse.options import Options
from tvmfuse.passes.attention import attention_decisions

TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 5e-3}  # relative, vs float64


def _compile(model, inputs: tuple | None, target: str = "cpu", dtype: str | None = None,
             options: Options | None = None):
    """(lowered module, IR after each stage, executable) of ``model`` as ``tvmfuse compile`` does it."""
    from tvmfuse.frontend import import_model
    from tvmfuse.pipeline import build, lower
    from tvmfuse.targets import get_target

    imported = import_model(model, inputs)
    stages: dict[str, tvm.IRModule] = {}
    spec = get_target(target)
    lowered = lower(imported.mod, spec, dtype, on_stage=lambda n, m: stages.__setitem__(n, m),
                    options=options)
    return lowered, stages, (build(lowered, spec) if target == "cpu" else None)


def _attention_calls(mod: tvm.IRModule) -> int:
    return sum(1 for f in mod.functions.values() if isinstance(f, relax.Function)
               for block in f.body.blocks for b in block.bindings
               if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "").startswith(
                   "relax.nn.attention"))


def _allocations(mod: tvm.IRModule) -> list[list[int]]:
    """Shapes of every tensor ``main`` allocates after ``finalize`` (``R.vm.alloc_tensor``)."""
    shapes = []

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.vm.alloc_tensor":
            shapes.append([int(d) for d in expr.args[2].values])

    relax.analysis.post_order_visit(mod["main"], visit)
    return shapes


def _check_fused(stages: dict[str, tvm.IRModule], lowered: tvm.IRModule, seq: int = forms.S) -> dict:
    fused = stages["fuse_attention"]
    decisions = attention_decisions(fused)
    assert _attention_calls(fused) == 1, decisions
    (decision,) = decisions
    assert decision["status"] == "fused", decision
    allocs = _allocations(lowered)
    assert allocs, "no allocation found: the check would be vacuous"
    scores = [s for s in allocs if s[-2:] == [seq, seq]]
    assert not scores, f"an (S, S) tensor is still allocated: {scores}"
    return decision


def _run(executable, inputs: tuple) -> np.ndarray:
    vm = relax.VirtualMachine(executable, tvm.cpu())
    out = vm["main"](*[tvm.runtime.from_dlpack(x.contiguous()) for x in inputs])
    out = out if hasattr(out, "numpy") else out[0]
    return torch.from_dlpack(out).double().numpy()


def _check_numerics(module: torch.nn.Module, inputs: tuple, got: np.ndarray, dtype) -> None:
    with torch.no_grad():
        ref = module.double()(*[x.double() if x.is_floating_point() else x for x in inputs]).numpy()
        own = module.to(dtype)(*inputs).double().numpy()
    assert got.shape == ref.shape
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    torch_err = np.linalg.norm(own - ref) / np.linalg.norm(ref)
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]} (torch's own {torch_err:.2e})"


@pytest.mark.parametrize("name", list(forms.FORMS))
def test_form_torch_export_fp16(name: str):
    module, inputs = forms.build(name)
    lowered, stages, exe = _compile(module, inputs)
    _check_fused(stages, lowered)
    _check_numerics(module, inputs, _run(exe, inputs), torch.float16)


@pytest.mark.parametrize("name", ["hand_written", "gqa_expand_reshape", "padding_additive",
                                  "soft_capped"])
def test_form_torch_export_bf16(name: str):
    module, inputs = forms.build(name, torch.bfloat16)
    lowered, stages, exe = _compile(module, inputs)
    _check_fused(stages, lowered)
    _check_numerics(module, inputs, _run(exe, inputs), torch.bfloat16)


@pytest.mark.parametrize("name", ["hand_written", "additive_finfo_min", "gqa_repeat_interleave",
                                  "sdpa_is_causal", "soft_capped"])
def test_form_fp32_module_as_float16(name: str):
    """An fp32 module compiled with ``--dtype float16``: attention is found before the conversion."""
    module, inputs = forms.build(name, torch.float32)
    lowered, stages, exe = _compile(module, inputs, dtype="float16")
    _check_fused(stages, lowered)
    # the fp16 conversion makes the attention an fp16 op
    (call,) = [b.value for b in stages["mixed_precision"]["main"].body.blocks[0].bindings
               if getattr(b.value, "op", None) is not None
               and getattr(b.value.op, "name", "") == "relax.nn.attention"]
    assert str(call.args[0].ty.dtype) == "float16"
    _check_numerics(module, inputs, _run(exe, inputs), torch.float16)


def test_fp32_minus_1e4_is_an_additive_bias():
    """-1e4 masks an fp32 score only if no visible score is below ~-9900: not proved a causal
    mask, so the kernel adds the constant as it is, a bias (left unfused before session 24)."""
    module, inputs = forms.build("additive_minus_1e4", torch.float32)
    lowered, stages, exe = _compile(module, inputs)
    decision = _check_fused(stages, lowered)
    assert (decision["causal"], decision["bias"]) == ("none", "yes"), decision
    _check_numerics(module, inputs, _run(exe, inputs), torch.float32)


def _check_window(stages: dict[str, tvm.IRModule], lowered: tvm.IRModule) -> None:
    """One fused attention with ``window_size = WINDOW`` (causal band, Sq == Skv: BottomRight)."""
    decision = _check_fused(stages, lowered)
    assert decision["window"] == str(forms.WINDOW) and decision["causal"] == "BottomRight", decision
    (call,) = [b.value for f in stages["fuse_attention"].functions.values()
               if isinstance(f, relax.Function) for block in f.body.blocks for b in block.bindings
               if isinstance(b.value, relax.Call)
               and getattr(b.value.op, "name", "") == "relax.nn.attention"]
    assert int(call.attrs.window_size) == forms.WINDOW


@pytest.mark.parametrize("how", forms.WINDOW_FORMS)
def test_sliding_window_torch_export_fp16(how: str):
    module, inputs = forms.sliding_window(how)
    lowered, stages, exe = _compile(module, inputs)
    _check_window(stages, lowered)
    _check_numerics(module, inputs, _run(exe, inputs), torch.float16)


@pytest.mark.parametrize("how", ["masked_fill_bool", "sdpa_bool"])
def test_sliding_window_fp32_module_as_float16(how: str):
    module, inputs = forms.sliding_window(how, torch.float32)
    lowered, stages, exe = _compile(module, inputs, dtype="float16")
    _check_window(stages, lowered)
    _check_numerics(module, inputs, _run(exe, inputs), torch.float16)


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
@pytest.mark.parametrize("how", ["masked_fill_bool", "additive", "sdpa_bool"])
def test_sliding_window_onnx_fp16(how: str, dynamo: bool, tmp_path):
    from models.export_onnx import export_onnx

    module, inputs = forms.sliding_window(how)
    path = export_onnx(module, inputs, tmp_path / f"{how}.onnx",
                       input_names=[f"input{i}" for i in range(3)], output_names=["output"],
                       opset=18 if dynamo else 17, dynamo=dynamo)
    lowered, stages, exe = _compile(str(path), None)
    _check_window(stages, lowered)
    _check_numerics(module, inputs, _run(exe, inputs), torch.float16)


def test_sliding_window_left_on_cuda_with_the_option_off():
    """``Options(gpu_window_attention=False)``: on sm90 and sm80 the band stays unfused with a
    reason naming the option."""
    module, inputs = forms.sliding_window(head_dim=64)
    for target in ("sm90", "sm80"):
        _, stages, _ = _compile(module, inputs, target=target,
                                options=Options(gpu_window_attention=False))
        fused = stages["fuse_attention"]
        assert _attention_calls(fused) == 0
        (decision,) = attention_decisions(fused)
        assert decision["status"] == "left", decision
        assert f"sliding-window band (each query sees its last {forms.WINDOW} keys)" in \
            decision["reason"] and "gpu_window_attention" in decision["reason"], decision


def test_sliding_window_one_kernel_sm90():
    """By default on sm90 the band runs in the wgmma flash kernel with the window in its spec."""
    import json

    module, inputs = forms.sliding_window(head_dim=64)
    _, stages, _ = _compile(module, inputs, target="sm90")
    kernels = [f for f in stages["legalize"].functions.values()
               if isinstance(f, tvm.tirx.PrimFunc) and "tvmfuse.rule" in f.attrs]
    assert [str(f.attrs["tvmfuse.rule"]) for f in kernels] == ["flash_attention_sm90"]
    assert "tvmfuse.fallback" not in kernels[0].attrs
    assert json.loads(str(kernels[0].attrs["tvmfuse.attention_spec"]))["window"] == forms.WINDOW


ONNX_FORMS = ["hand_written", "padding_masked_fill", "gqa_repeat_interleave", "sdpa_is_causal",
              "soft_capped", "latent_rope"]


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
@pytest.mark.parametrize("name", ONNX_FORMS)
def test_form_onnx_fp16(name: str, dynamo: bool, tmp_path):
    from models.export_onnx import export_onnx

    module, inputs = forms.build(name)
    names = [f"input{i}" for i in range(len(inputs))]
    path = export_onnx(module, inputs, tmp_path / f"{name}.onnx", input_names=names,
                       output_names=["output"], opset=18 if dynamo else 17, dynamo=dynamo)
    lowered, stages, exe = _compile(str(path), None)
    _check_fused(stages, lowered)
    _check_numerics(module, inputs, _run(exe, inputs), torch.float16)


def test_decoder_layer_fp16():
    """Issue 13 item 7: models/decoder_layer.py built in fp16 (as tools/bench/bench_decoder.py does)."""
    from models import decoder_layer

    seq = 24  # head dim 16: an (S, S) allocation is the scores
    module, inputs = decoder_layer.build(seq=seq, dtype=torch.float16)
    lowered, stages, exe = _compile(module, inputs)
    decision = _check_fused(stages, lowered, seq)
    assert decision["causal"] == "TopLeft" and decision["group"] == "2", decision
    _check_numerics(module, inputs, _run(exe, inputs), torch.float16)


@pytest.mark.parametrize("name", ["hand_written", "gqa_expand_reshape", "einsum", "baddbmm",
                                  "soft_capped"])
def test_form_one_kernel_sm90(name: str):
    """On sm90 the scores of item 1 never leave the wgmma flash-attention kernel.

    Only layout kernels remain beside it (Q/K/V in (B, H, S, D) are packed to the kernel's BSHD):
    no matmul, softmax or mask kernel.
    """
    module, inputs = forms.build(name, head_dim=64)  # the flash kernels take head dim 64 or 128
    _, stages, _ = _compile(module, inputs, target="sm90")
    assert _attention_calls(stages["fuse_attention"]) == 1
    kernels = [f for f in stages["legalize"].functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    rules = [str(f.attrs["tvmfuse.rule"]) for f in kernels if "tvmfuse.rule" in f.attrs]
    assert rules == ["flash_attention_sm90"], rules
    names = [gv.name_hint for gv, f in stages["fuse_tir"].functions.items()
             if isinstance(f, tvm.tirx.PrimFunc)]
    assert not [n for n in names if any(op in n for op in ("matmul", "softmax", "where"))], names


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["sm90", "sm80"])
@pytest.mark.parametrize("how", ["masked_fill_bool", "sdpa_bool"])
def test_sliding_window_gpu_matches_torch(how: str, target: str, tmp_path):
    """The band on the GPU flash kernels (head dim 64, window honoured): output against torch."""
    import tvmfuse

    module, inputs = forms.sliding_window(how, head_dim=64)
    options = Options(gpu_window_attention=True)
    _, stages, _ = _compile(module, inputs, target=target, options=options)
    (kernel,) = [f for gv, f in stages["legalize"].functions.items()
                 if gv.name_hint in ("attention", "flash_attention")]
    assert "tvmfuse.fallback" not in kernel.attrs, kernel.attrs["tvmfuse.fallback"]
    lib = tvmfuse.compile(module, inputs, target=target, options=options)
    model = tvmfuse.load(lib.export(tmp_path / f"{how}.so"), device="cuda")
    got = model(*[x.cuda() for x in inputs])
    got = (got if isinstance(got, torch.Tensor) else got[0]).double().cpu().numpy()
    _check_numerics(module, inputs, got, torch.float16)

MLA_ON = Options(gpu_mla_attention=True)


def _latent_rope_kernel(target: str):
    """The latent-rope form at head dim 128 (q·k over 192, values 128) compiled for ``target``
    with the CUDA kernel for it on: (module, inputs, its one attention kernel, the fused kernels'
    names)."""
    module, inputs = forms.build("latent_rope", head_dim=128)
    _, stages, _ = _compile(module, inputs, target=target, options=MLA_ON)
    assert _attention_calls(stages["fuse_attention"]) == 1
    (kernel,) = [f for gv, f in stages["legalize"].functions.items()
                 if gv.name_hint in ("attention", "flash_attention")]
    names = [gv.name_hint for gv, f in stages["fuse_tir"].functions.items()
             if isinstance(f, tvm.tirx.PrimFunc)]
    return module, inputs, kernel, names


def test_latent_rope_left_on_cuda_until_the_option():
    """By default a CUDA target leaves MLA unfused, with the reason (the kernel's GPU numerics
    have not run); the cpu target fuses it (test_form_torch_export_fp16)."""
    module, inputs = forms.build("latent_rope", head_dim=128)
    _, stages, _ = _compile(module, inputs, target="sm90")
    assert _attention_calls(stages["fuse_attention"]) == 0
    (decision,) = attention_decisions(stages["fuse_attention"])
    assert "Options(gpu_mla_attention=True)" in decision["reason"], decision


def test_latent_rope_one_flash_kernel_sm90():
    """DeepSeek's MLA widths (q, k 192; v 128) were left unfused ("key shape and value shape
    differ") before session 46; with Options.gpu_mla_attention one mma.sync flash kernel, on sm90
    with the reason it is not the wgmma one, and no score-matrix kernel beside it."""
    _, _, kernel, names = _latent_rope_kernel("sm90")
    assert "ldmatrix" in kernel.script()  # the flash kernel, not the CUDA-core row fallback
    assert "value head dim 128 differs" in str(kernel.attrs["tvmfuse.fallback"])
    shapes = re.findall(r"T.Buffer\(\(([\d, ]+)\)", kernel.script())[:4]  # q, k, v, out
    B, S, H = forms.B, forms.S, forms.H  # q, k, v (B, S, H, D); out in the consumer's (B, H, S, Dv)
    assert shapes == [f"{B}, {S}, {H}, 192", f"{B}, {S}, {H}, 192", f"{B}, {S}, {H}, 128",
                      f"{B}, {H}, {S}, 128"], shapes
    assert not [n for n in names if any(op in n for op in ("matmul", "softmax", "where"))], names


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["sm90", "sm80"])
def test_latent_rope_gpu_matches_torch(target: str, tmp_path):
    """The MLA widths on the GPU (the sm80 flash kernel with 192-wide q, k and 128-wide v)."""
    import tvmfuse

    module, inputs, kernel, _ = _latent_rope_kernel(target)
    assert "ldmatrix" in kernel.script()  # the flash kernel, not the CUDA-core row fallback
    lib = tvmfuse.compile(module, inputs, target=target, options=MLA_ON)
    model = tvmfuse.load(lib.export(tmp_path / "latent_rope.so"), device="cuda")
    got = model(*[x.cuda() for x in inputs])
    got = (got if isinstance(got, torch.Tensor) else got[0]).double().cpu().numpy()
    _check_numerics(module, inputs, got, torch.float16)


BIAS_FORMS = ["padding_masked_fill",  # a data-dependent padding mask: an additive bias operand
              "alibi_fp32_bias"]  # a constant fp32 one
GPU_FORMS = ["hand_written", "additive_finfo_min", "padding_masked_fill", "gqa_expand_reshape",
             "bshd_inputs", "sdpa_enable_gqa", "einsum", "baddbmm", "clamped_heads_folded",
             "alibi_fp32_bias", "soft_capped"]


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["sm90", "sm80", "sm90_bias"])
@pytest.mark.parametrize("name", GPU_FORMS)
def test_form_gpu_matches_torch(name: str, target: str, tmp_path):
    """The fused forms on the GPU flash kernels (head dim 64): output against torch in float64.
    ``sm90_bias`` (the bias forms only): sm90 with ``Options.sm90_attention_bias`` on, the padding
    mask's additive bias in the wgmma kernel (the default); ``sm90``: with it off."""
    import tvmfuse

    bias_on = target == "sm90_bias"
    if bias_on and name not in BIAS_FORMS:
        pytest.skip("no additive bias: the same kernel as sm90")
    target = "sm90" if bias_on else target
    options = Options(sm90_attention_bias=bias_on)
    module, inputs = forms.build(name, head_dim=64)
    _, stages, _ = _compile(module, inputs, target=target, options=options)
    assert _attention_calls(stages["fuse_attention"]) == 1
    (kernel,) = [f for gv, f in stages["legalize"].functions.items()
                 if gv.name_hint in ("attention", "flash_attention")]
    if name in BIAS_FORMS and target == "sm90" and not bias_on:
        assert "sm90_attention_bias off" in str(kernel.attrs["tvmfuse.fallback"]), kernel.attrs
    else:
        assert "tvmfuse.fallback" not in kernel.attrs, kernel.attrs["tvmfuse.fallback"]
    lib = tvmfuse.compile(module, inputs, target=target, options=options)
    model = tvmfuse.load(lib.export(tmp_path / f"{name}.so"), device="cuda")
    got = model(*[x.cuda() for x in inputs])
    got = (got if isinstance(got, torch.Tensor) else got[0]).double().cpu().numpy()
    _check_numerics(module, inputs, got, torch.float16)


class _MaskUnderTheCap(torch.nn.Module):
    """The causal mask added *before* the soft cap: ``tanh(-inf) · cap = -cap`` hides nothing."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s + torch.full((q.shape[2], q.shape[2]), float("-inf")).triu(1)
        return torch.softmax(torch.tanh(s / 2.0) * 2.0, dim=-1) @ v


def test_soft_cap_is_the_kernels_softcap():
    """Gemma-2's ``tanh(s / cap) · cap`` (left unfused before session 45: "no attention kernel
    takes a soft cap") is the spec's ``softcap``: recorded in the decision, carried in
    ``causal_mask`` and read back into the sm90a kernel's spec with the scale outside the tanh."""
    import json

    from tvmfuse.attrs import parse_causal_attr

    module, inputs = forms.build("soft_capped", head_dim=64)
    _, stages, _ = _compile(module, inputs, target="sm90")
    (decision,) = attention_decisions(stages["fuse_attention"])
    assert decision["status"] == "fused" and decision["softcap"] == "2.0", decision
    (call,) = [b.value for b in stages["fuse_attention"]["main"].body.blocks[0].bindings
               if getattr(getattr(b.value, "op", None), "name", "") == "relax.nn.attention"]
    assert parse_causal_attr(call.attrs.causal_mask) == ("TopLeft", 2.0)
    (kernel,) = [f for f in stages["legalize"].functions.values()
                 if isinstance(f, tvm.tirx.PrimFunc) and "tvmfuse.attention_spec" in f.attrs]
    spec = json.loads(str(kernel.attrs["tvmfuse.attention_spec"]))
    assert (spec["softcap"], spec["causal"]) == (2.0, "TopLeft")
    assert spec["scale"] == pytest.approx(forms.D ** -0.5)


def test_mask_under_the_soft_cap_is_left():
    """A mask inside the tanh is no mask (the kernels mask after the cap): left, with the reason,
    and the unfused graph still computes torch's numbers."""
    module = _MaskUnderTheCap()
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    _, stages, executable = _compile(module, (q, k, v))
    (decision,) = attention_decisions(stages["fuse_attention"])
    assert decision["status"] == "left" and "inside the soft cap" in decision["reason"], decision
    np.testing.assert_allclose(_run(executable, (q, k, v)), module(q, k, v).numpy(), rtol=1e-4,
                               atol=1e-5)


def _bloom():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4)
    return transformers.BloomForCausalLM(cfg).eval()


def test_bloom_alibi_attention_is_fused():
    """transformers' Bloom at random init: ``baddbmm(alibi, q, kᵀ)`` on heads-folded tensors with a
    per-head (B·H, 1, S) ALiBi bias, then the causal mask. LiftFoldedBatch reshapes the bias with
    q and k, and FuseAttention takes the constant per-key bias as the kernel's bias beside the
    causal mask (it is finite and masks nothing): one attention a layer (was 27 kernels, the
    scores in memory), the cpu build equal to torch."""
    from tests.test_llm_import_lm import Logits
    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    model = Logits(_bloom())
    ids = torch.randint(0, 128, (1, 32))
    _, stages, executable = _compile(model, (ids,))
    decisions = attention_decisions(stages["fuse_attention"])
    assert [(d["status"], d["causal"], d["bias"]) for d in decisions] == [
        ("fused", "TopLeft", "yes")] * 2, decisions
    with torch.no_grad():
        want = model(ids).numpy()
    got = _run(executable, (ids,))
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    report = analyze(import_model(model, (ids,)).mod, get_target("sm90"), "float16", stock=False)
    assert sum(k["name"] == "attention" for k in report["kernels"]) == 2, report["kernels"]


def test_bloom_compile_lm_refuses_alibi_with_the_reason():
    """The derived KV cache carries no ALiBi bias yet: compile_lm says so, naming ALiBi."""
    import tvmfuse
    from tvmfuse.errors import CompileError

    with pytest.raises(CompileError, match="ALiBi"):
        tvmfuse.compile_lm(_bloom(), target="cpu", max_seq_len=64, prefill_lengths=[16])


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["sm90", "sm80"])
def test_bloom_alibi_gpu_matches_torch(target, tmp_path):
    """Bloom's ALiBi bias (1, H, 1, S) through the GPU attention kernels (sm_90a: the kernel
    without bias support falls back to one that has it), fp16, against float64 torch."""
    transformers = pytest.importorskip("transformers")
    from tests.cuda_tools import check_vs_float64
    from tests.test_llm_import_lm import Logits

    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=128, hidden_size=256, n_layer=2, n_head=4)
    model = Logits(transformers.BloomForCausalLM(cfg).eval().half())
    check_vs_float64(model, (torch.randint(0, 128, (1, 128)),), target, tmp_path, 1e-2)
