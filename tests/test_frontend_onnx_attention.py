"""The standard ONNX ``Attention`` op (opsets 23–25) and the dynamo exporter's scalar-axes ``Unsqueeze``.

Graphs built with ``onnx.helper``, imported by tvmfuse (one ``R.nn.attention``, no softmax, for the
forms the kernels take, soft cap included; plain Relax ops for ``qk_matmul_output`` and the rest), compiled
for the cpu target and compared with onnxruntime (which runs opset-23 Attention on the CPU) or the
ONNX reference implementation on random inputs; what the converter does not handle is refused by
name before conversion. ``F.scaled_dot_product_attention`` exported by the dynamo exporter at
opset 23 (one ``Attention`` node) is compiled and compared with torch. The ``Unsqueeze`` fix is
checked on a hand-built graph and on ``F.scaled_dot_product_attention(enable_gqa=True)`` exported
by the dynamo exporter (opset 18).
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import tvmfuse
from tvmfuse.errors import UnsupportedOpError
from tvmfuse.frontend import import_model

B, HQ, HKV, SQ, SKV, D = 2, 4, 2, 8, 12, 16
_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bool": TensorProto.BOOL,
          "int64": TensorProto.INT64}


def _model(inputs: dict[str, tuple[tuple[int, ...], str]], outputs: list[str], attrs: dict,
           node_inputs: list[str] | None = None, nodes: int = 1, opset: int = 23) -> onnx.ModelProto:
    """One (or ``nodes`` chained on Q) opset-23 Attention node(s) over graph inputs ``inputs``."""
    graph_inputs = [helper.make_tensor_value_info(n, _TYPES[dt], list(s)) for n, (s, dt) in inputs.items()]
    names = node_inputs or list(inputs)
    dtype = inputs[names[0]][1]
    made, q = [], names[0]
    for i in range(nodes):
        outs = outputs if i == nodes - 1 else [f"y{i}"]
        made.append(helper.make_node("Attention", [q, *names[1:]], outs, name=f"attn{i}", **attrs))
        q = outs[0]
    graph = helper.make_graph(made, "g", graph_inputs,
                              [helper.make_tensor_value_info(o, _TYPES[dtype], None) for o in outputs if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(model)


def _inputs(model: onnx.ModelProto, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for inp in model.graph.input:
        shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
        if inp.type.tensor_type.elem_type == TensorProto.BOOL:
            keep = rng.random(shape) < 0.7
            keep[..., 0] = True  # every query row keeps a key
            arrays.append(keep)
        elif inp.type.tensor_type.elem_type == TensorProto.INT64:  # nonpad_kv_seqlen: 1 … Skv
            arrays.append(rng.integers(1, SKV + 1, shape).astype("int64"))
        else:
            dtype = "float16" if inp.type.tensor_type.elem_type == TensorProto.FLOAT16 else "float32"
            arrays.append(rng.standard_normal(shape).astype(dtype))
    return arrays


def _check(model: onnx.ModelProto, tmp_path, rtol: float = 1e-4, ort: bool = True,
           fused: bool = True) -> tvmfuse.Library:
    """Import, compile, run; against onnxruntime, or (``ort=False``: forms onnxruntime 1.23
    rejects or lacks, masks of shape (·, 1, Skv) or shorter than Skv among them) the ONNX
    reference implementation. ``fused``: each node is one ``R.nn.attention`` (else plain ops)."""
    path = tmp_path / "attention.onnx"
    onnx.save(model, path)
    imported = import_model(str(path))
    text = imported.mod.script(show_meta=False)
    calls = len(re.findall(r"R\.nn\.attention(?:_bias)?\(", text))
    assert calls == (sum(n.op_type == "Attention" for n in model.graph.node) if fused else 0)
    assert ("R.nn.softmax" in text) != fused
    lib = tvmfuse.compile(str(path), target="cpu")
    arrays = _inputs(model)
    out = lib.load()(*arrays)
    outs = list(out) if isinstance(out, tuple) else [out]
    if ort:
        refs = lib.model.reference(*arrays)
    else:
        from onnx.reference import ReferenceEvaluator

        feeds = {i.name: a for i, a in zip(model.graph.input, arrays)}
        refs = ReferenceEvaluator(model).run(None, feeds)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype
        finite = np.isfinite(r)  # qk_matmul_output mode 2 holds the mask's -inf: the same places
        np.testing.assert_array_equal(o[~finite], r[~finite])
        o, r = o[finite].astype(np.float64), r[finite].astype(np.float64)
        err = np.linalg.norm(o - r) / np.linalg.norm(r)
        assert err <= rtol, f"relative error {err:.3e} > {rtol}"
    return lib


def _qkv(dtype: str = "float32", rank: int = 4, hkv: int = HKV) -> dict:
    if rank == 4:
        return {"q": ((B, HQ, SQ, D), dtype), "k": ((B, hkv, SKV, D), dtype), "v": ((B, hkv, SKV, D), dtype)}
    return {"q": ((B, SQ, HQ * D), dtype), "k": ((B, SKV, hkv * D), dtype), "v": ((B, SKV, hkv * D), dtype)}


@pytest.mark.parametrize("attrs", [{}, {"is_causal": 1}, {"scale": 0.3}, {"is_causal": 1, "scale": 0.1}],
                         ids=["plain", "causal", "scale", "causal_scale"])
def test_gqa_4d(attrs: dict, tmp_path):
    _check(_model(_qkv(), ["y"], attrs), tmp_path)


def test_mha_3d_heads_from_attributes(tmp_path):
    model = _model(_qkv(rank=3, hkv=HQ), ["y"], {"q_num_heads": HQ, "kv_num_heads": HQ, "is_causal": 1})
    _check(model, tmp_path)


def test_gqa_3d(tmp_path):
    _check(_model(_qkv(rank=3), ["y"], {"q_num_heads": HQ, "kv_num_heads": HKV}), tmp_path)


@pytest.mark.parametrize("shape,dtype,ort", [
    ((SQ, SKV), "bool", True), ((B, 1, SQ, SKV), "bool", True), ((HQ, SQ, SKV), "float32", True),
    ((B, 1, 1, SKV), "float32", False), ((SQ, SKV - 4), "bool", False)],
    ids=["bool_2d", "bool_4d", "float_3d", "float_padding", "bool_short_padded"])
def test_attn_mask(shape: tuple[int, ...], dtype: str, ort: bool, tmp_path):
    inputs = {**_qkv(), "mask": (shape, dtype)}
    _check(_model(inputs, ["y"], {}), tmp_path, ort=ort)


def test_mask_and_causal(tmp_path):
    _check(_model({**_qkv(), "mask": ((B, 1, SQ, SKV), "float32")}, ["y"], {"is_causal": 1}), tmp_path)


def test_padding_mask_and_causal(tmp_path):
    """A (B, 1, 1, Skv) mask with is_causal: onnxruntime rejects the shape and the ONNX reference
    takes the causal mask's query length from the mask's (1); the reference is onnxruntime on the
    same mask broadcast to (B, 1, Sq, Skv)."""
    model = _model({**_qkv(), "mask": ((B, 1, 1, SKV), "float32")}, ["y"], {"is_causal": 1})
    path = tmp_path / "padding.onnx"
    onnx.save(model, path)
    arrays = _inputs(model)
    out = tvmfuse.compile(str(path), target="cpu").load()(*arrays)
    full = _model({**_qkv(), "mask": ((B, 1, SQ, SKV), "float32")}, ["y"], {"is_causal": 1})
    onnx.save(full, tmp_path / "full.onnx")
    ref_lib = tvmfuse.compile(str(tmp_path / "full.onnx"), target="cpu")
    (ref,) = ref_lib.model.reference(*arrays[:3], np.broadcast_to(arrays[3], (B, 1, SQ, SKV)).copy())
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err <= 1e-4, err


def test_present_key_value_outputs(tmp_path):
    """Without a past, present_key / present_value are K and V in (B, Hkv, Skv, D)."""
    lib = _check(_model(_qkv(rank=3), ["y", "present_key", "present_value"],
                        {"q_num_heads": HQ, "kv_num_heads": HKV}), tmp_path)
    assert [s.name for s in lib.model.inputs] == ["q", "k", "v"]


def test_fp16(tmp_path):
    _check(_model(_qkv("float16"), ["y"], {"is_causal": 1}), tmp_path, rtol=5e-3)


def test_softmax_precision_float(tmp_path):
    _check(_model(_qkv("float16"), ["y"], {"softmax_precision": TensorProto.FLOAT}), tmp_path, rtol=5e-3)


PAST = 5  # past_key / past_value length: Skv = PAST + SKV


def _past(dtype: str = "float32", hkv: int = HKV, dv: int = D) -> dict:
    return {"past_key": ((B, hkv, PAST, D), dtype), "past_value": ((B, hkv, PAST, dv), dtype)}


_QK = ["y", "present_key", "present_value", "qk"]


@pytest.mark.parametrize("attrs", [{}, {"is_causal": 1}], ids=["plain", "causal"])
def test_past_and_present(attrs: dict, tmp_path):
    """K, V appended to the cache (Skv = PAST + SKV != Sq: the causal offset is the past length,
    neither TopLeft nor BottomRight, so it is a bias) with a mask shorter than Skv (padded)."""
    inputs = {**_qkv(rank=3), "mask": ((SQ, SKV), "float32"), **_past()}
    model = _model(inputs, ["y", "present_key", "present_value"],
                   {"q_num_heads": HQ, "kv_num_heads": HKV, **attrs})
    _check(model, tmp_path, ort=False)


def test_past_and_present_fp16_bottom_right(tmp_path):
    """Sq == new keys: causal after a past is BottomRight, the kernel's own causal mask."""
    inputs = {"q": ((B, HQ, SQ, D), "float16"), "k": ((B, HKV, SQ, D), "float16"),
              "v": ((B, HKV, SQ, D), "float16"), **_past("float16")}
    names = ["q", "k", "v", "", "past_key", "past_value"]
    model = _model(inputs, ["y", "present_key", "present_value"], {"is_causal": 1}, node_inputs=names)
    onnx.save(model, tmp_path / "m.onnx")
    assert 'causal_mask="BottomRight"' in import_model(str(tmp_path / "m.onnx")).mod.script()
    _check(model, tmp_path, rtol=5e-3, ort=False)


@pytest.mark.parametrize("attrs", [{}, {"is_causal": 1}, {"is_causal": 1, "left_window_size": 3}],
                         ids=["padding", "causal", "causal_window"])
def test_nonpad_kv_seqlen(attrs: dict, tmp_path):
    """A static KV cache: keys from nonpad_kv_seqlen[b] on are hidden; causal / window
    positions are offset per batch row by nonpad_kv_seqlen[b] - Sq (a bias built at run time)."""
    inputs = {**_qkv(), "nonpad": ((B,), "int64")}
    names = ["q", "k", "v", "", "", "", "nonpad"]
    _check(_model(inputs, ["y"], attrs, node_inputs=names, opset=25), tmp_path, ort=False)


@pytest.mark.parametrize("attrs,window", [
    ({"is_causal": 1, "left_window_size": 3}, "window_size=4"),
    ({"left_window_size": 2, "right_window_size": 0}, "window_size=3"),
    ({"left_window_size": 1, "right_window_size": 2}, None),
    ({"left_window_size": -1, "right_window_size": -1}, None)],
    ids=["causal_band", "right0_band", "bidirectional", "unbounded"])
def test_local_window(attrs: dict, window: str | None, tmp_path):
    """A causal band is the kernel's window_size; any other window is a constant −inf bias."""
    model = _model(_qkv(), ["y"], attrs, opset=25)
    onnx.save(model, tmp_path / "m.onnx")
    text = import_model(str(tmp_path / "m.onnx")).mod.script()
    assert (window in text) if window else re.search(r"window_size=\d", text) is None
    _check(model, tmp_path, ort=False)


@pytest.mark.parametrize("attrs", [{"softcap": 2.0}, {"softcap": 3.0, "is_causal": 1}],
                         ids=["mask", "causal"])
def test_softcap_is_the_kernels(attrs: dict, tmp_path):
    """``softcap`` alone (with a past and a mask, or causal): one ``R.nn.attention`` carrying the
    soft cap (plain Relax ops before session 45)."""
    inputs = {**_qkv(), "mask": ((B, 1, SQ, PAST + SKV), "bool"), **_past()}
    _check(_model(inputs, ["y", "present_key", "present_value"], attrs), tmp_path, ort=False)


@pytest.mark.parametrize("attrs", [
    {"qk_matmul_output_mode": 0}, {"qk_matmul_output_mode": 1, "softcap": 3.0},
    {"qk_matmul_output_mode": 2, "is_causal": 1}, {"qk_matmul_output_mode": 3},
    {"softmax_precision": TensorProto.DOUBLE, "softcap": 5.0}],
    ids=["qk0", "qk1_softcap", "qk2_causal", "qk3", "fp64_softmax"])
def test_decomposed(attrs: dict, tmp_path):
    """qk_matmul_output / an fp64 softmax: plain Relax ops, with a past and a mask."""
    inputs = {**_qkv(), "mask": ((B, 1, SQ, PAST + SKV), "bool"), **_past()}
    outputs = _QK if "qk_matmul_output_mode" in attrs else ["y", "present_key", "present_value"]
    _check(_model(inputs, outputs, attrs), tmp_path, ort=False, fused=False)


def test_gqa_value_head_dim_differs(tmp_path):
    """GQA with Dv != D has no kernel (and TVM's lowering no GQA): plain Relax ops."""
    inputs = {**_qkv(rank=3), "v": ((B, SKV, HKV * 8), "float32")}
    model = _model(inputs, ["y"], {"q_num_heads": HQ, "kv_num_heads": HKV, "is_causal": 1})
    _check(model, tmp_path, ort=False, fused=False)


@pytest.mark.parametrize("attrs,extra,why", [
    ({"softmax_precision": TensorProto.INT32}, [], "attribute softmax_precision=6"),
    ({}, ["", "past_key"], "input past_key without past_value"),
    ({}, ["", "past_key", "past_value", "nonpad"], "input nonpad_kv_seqlen with past_key"),
], ids=["softmax_int", "past_key_alone", "nonpad_and_past"])
def test_refused_with_node_and_attribute(attrs, extra, why, tmp_path):
    inputs = _qkv()
    names = list(inputs)
    if extra:
        inputs = {**inputs, **_past(), "nonpad": ((B,), "int64")}
        names = [*names, *extra]
    model = _model(inputs, ["y"], attrs, node_inputs=names, nodes=2)
    path = tmp_path / "refused.onnx"
    onnx.save(model, path)
    with pytest.raises(UnsupportedOpError) as err:
        import_model(str(path))
    # every node that asks for it is named, all at once
    assert [n for n, w in err.value.unsupported if why in w] == ["attn0", "attn1"], err.value.unsupported
    assert f"node 'attn1': op Attention {why}" in str(err.value)


# --- Unsqueeze with a scalar axes constant ----------------------------------------------------------


def test_unsqueeze_scalar_axes(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])
    scalar = helper.make_tensor("a", TensorProto.INT64, [], [1])  # 0-d, as the dynamo exporter writes
    axes = helper.make_node("Constant", [], ["axes"], value=scalar)
    node = helper.make_node("Unsqueeze", ["x", "axes"], ["y"], name="unsq")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([axes, node], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "unsqueeze.onnx"
    onnx.save(model, path)
    lib = tvmfuse.compile(str(path), target="cpu")
    arr = np.random.default_rng(0).standard_normal((3, 5)).astype("float32")
    out = lib.load()(arr)
    (ref,) = lib.model.reference(arr)
    assert out.shape == ref.shape == (3, 1, 5)
    np.testing.assert_array_equal(out, ref)


class SdpaGqa(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_dynamo_export_sdpa_enable_gqa(tmp_path):
    """The dynamo exporter's GQA SDPA (scalar-axes Unsqueeze) imports, fuses and matches torch."""
    from models.export_onnx import export_onnx
    from tvmfuse.passes.attention import attention_decisions
    from tvmfuse.pipeline import lower
    from tvmfuse.targets import get_target

    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(B, HQ, SQ, D, generator=g), torch.randn(B, HKV, SQ, D, generator=g),
              torch.randn(B, HKV, SQ, D, generator=g))
    module = SdpaGqa().eval()
    path = export_onnx(module, inputs, tmp_path / "gqa.onnx", input_names=["q", "k", "v"],
                       output_names=["out"], opset=18, dynamo=True)
    proto = onnx.load(str(path))
    scalar_axes = [n for n in proto.graph.node if n.op_type == "Unsqueeze"]
    assert scalar_axes, "the export no longer writes Unsqueeze: the regression is not exercised"
    stages = {}
    lower(import_model(str(path)).mod, get_target("cpu"), on_stage=lambda n, m: stages.__setitem__(n, m))
    (decision,) = attention_decisions(stages["fuse_attention"])
    assert decision["status"] == "fused" and decision["group"] == str(HQ // HKV), decision
    lib = tvmfuse.compile(str(path), target="cpu")
    out = lib.load()(*[x.numpy() for x in inputs])
    ref = module(*inputs).numpy()
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err <= 1e-4, err


class Sdpa(torch.nn.Module):
    """Self-attention over given q, k, v the way a user writes it: SDPA with a mask or causal."""

    def __init__(self, causal: bool, gqa: bool):
        super().__init__()
        self.causal, self.gqa = causal, gqa

    def forward(self, q, k, v, mask):
        if self.causal:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=self.gqa)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2,
                                                                enable_gqa=self.gqa)


@pytest.mark.parametrize("causal,gqa", [(True, False), (False, False), (True, True)],
                         ids=["causal", "mask_scale", "causal_gqa"])
def test_dynamo_export_sdpa_opset23_attention(causal: bool, gqa: bool, tmp_path):
    """torch 2.13's dynamo exporter writes SDPA at opset 23 as the ONNX ``Attention`` op; the
    compiled library matches torch."""
    from models.export_onnx import export_onnx

    g = torch.Generator().manual_seed(1)
    hkv = HKV if gqa else HQ
    inputs = (torch.randn(B, HQ, SQ, D, generator=g), torch.randn(B, hkv, SQ, D, generator=g),
              torch.randn(B, hkv, SQ, D, generator=g), torch.rand(SQ, SQ, generator=g) > 0.3)
    inputs[3][:, 0] = True  # every query keeps a key
    module = Sdpa(causal, gqa).eval()
    path = export_onnx(module, inputs, tmp_path / "sdpa.onnx", input_names=["q", "k", "v", "mask"],
                       output_names=["out"], opset=23, dynamo=True)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("Attention") == 1, ops
    lib = tvmfuse.compile(str(path), target="cpu")
    arrays = [x.numpy() for x in inputs][:len(lib.model.inputs)]  # an unused mask is no input
    out = lib.load()(*arrays)
    ref = module(*inputs).numpy()
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err <= 1e-4, err


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["past_causal_mask", "nonpad_causal", "softcap_qk"])
def test_fp16_forms_on_sm90(form: str, tmp_path):
    """The KV-cache forms (one flash kernel with a bias) and the decomposed form, fp16, head dim 64,
    built for sm90 and run on the GPU: close to the ONNX reference."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 library needs an sm_90 GPU")
    from onnx.reference import ReferenceEvaluator

    d, f16 = 64, "float16"
    inputs = {"q": ((B, HQ, SQ, d), f16), "k": ((B, HKV, SQ, d), f16), "v": ((B, HKV, SQ, d), f16)}
    names, outputs, attrs = ["q", "k", "v"], ["y"], {"is_causal": 1}
    if form == "past_causal_mask":
        inputs |= {"mask": ((SQ, PAST + SQ), f16), "past_key": ((B, HKV, PAST, d), f16),
                   "past_value": ((B, HKV, PAST, d), f16)}
        names, outputs = list(inputs), ["y", "present_key", "present_value"]
    elif form == "nonpad_causal":
        inputs["nonpad"] = ((B,), "int64")
        names = [*names, "", "", "", "nonpad"]
    else:
        attrs, outputs = {"softcap": 20.0, "qk_matmul_output_mode": 1}, ["y", "", "", "qk"]
    model = _model(inputs, outputs, attrs, node_inputs=names)
    onnx.save(model, tmp_path / "m.onnx")
    tvmfuse.compile(str(tmp_path / "m.onnx"), target="sm90").export(tmp_path / "m.so")
    arrays = _inputs(model)
    if form == "nonpad_causal":
        arrays[-1] = np.minimum(arrays[-1], SQ)
    got = tvmfuse.load(tmp_path / "m.so", device="cuda")(*[torch.from_numpy(a).cuda() for a in arrays])
    got = list(got) if isinstance(got, tuple | list) else [got]
    f32 = [a.astype("float32") if a.dtype == np.float16 else a for a in arrays]
    ref_model = _model({n: (s, "float32" if t == f16 else t) for n, (s, t) in inputs.items()},
                       outputs, attrs, node_inputs=names)
    refs = ReferenceEvaluator(ref_model).run(None, {i.name: a for i, a in zip(ref_model.graph.input, f32)})
    for o, r in zip(got, refs):
        o = o.float().cpu().numpy()
        assert np.linalg.norm(o - r) / np.linalg.norm(r) <= 5e-3
