"""The transformer-era ONNX ops tvmfuse converts itself: RMSNormalization (several axes),
RotaryEmbedding, Swish, SwiGLU, TensorScatter, CausalConvWithState and LinearAttention.

One-node graphs built with ``onnx.helper`` in forms the ONNX node tests miss (fp16, 3-D
interleaved partial rotation, the cache on the last axis, GQA recurrences with a past state, …),
compiled for the cpu target and compared with the ONNX reference implementation on random
inputs; refused forms name the node and the op. ``torch.nn.RMSNorm`` over two axes, exported by
the dynamo exporter at opset 23 (one ``RMSNormalization`` node), is compared with torch.
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

_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64}


def _model(op: str, inputs: dict[str, tuple[tuple[int, ...], str]], outputs: list[str], opset: int,
           node_inputs: list[str] | None = None, **attrs) -> onnx.ModelProto:
    graph_inputs = [helper.make_tensor_value_info(n, _TYPES[dt], list(s)) for n, (s, dt) in inputs.items()]
    node = helper.make_node(op, node_inputs or list(inputs), outputs, name=f"my_{op.lower()}", **attrs)
    graph = helper.make_graph([node], "g", graph_inputs, [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    model.graph.output.extend(inferred[o] for o in outputs)  # the output types ONNX infers
    return model


def _arrays(model: onnx.ModelProto, ints: int, seed: int = 0) -> list[np.ndarray]:
    """Random non-zero floats; int64 inputs (positions, write indices) in [0, ints)."""
    rng = np.random.default_rng(seed)
    out = []
    for inp in model.graph.input:
        shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
        if inp.type.tensor_type.elem_type == TensorProto.INT64:
            out.append(rng.integers(0, ints, shape).astype("int64"))
        else:
            dtype = "float16" if inp.type.tensor_type.elem_type == TensorProto.FLOAT16 else "float32"
            out.append((rng.uniform(0.2, 1.0, shape) * rng.choice([-1, 1], shape)).astype(dtype))
    return out


def _check(model: onnx.ModelProto, tmp_path, rtol: float = 1e-5, ints: int = 4) -> str:
    """Compile, run, compare every output with the ONNX reference; the imported IR's text."""
    from onnx.reference import ReferenceEvaluator

    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    text = import_model(str(path)).mod.script(show_meta=False)
    arrays = _arrays(model, ints)
    out = tvmfuse.compile(str(path), target="cpu").load()(*arrays)
    outs = list(out) if isinstance(out, tuple) else [out]
    refs = ReferenceEvaluator(model).run(None, {i.name: a for i, a in zip(model.graph.input, arrays)})
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, r.shape, o.dtype, r.dtype)
        err = np.linalg.norm(o.astype(np.float64) - r) / np.linalg.norm(r.astype(np.float64))
        assert err <= rtol, f"relative error {err:.3e} > {rtol}"
    return text


@pytest.mark.parametrize("shape,wshape,axis,dtype", [
    ((2, 3, 8), (8,), -1, "float16"), ((2, 3, 8), (3, 8), 1, "float16"), ((4, 6), (4, 6), 0, "float32")],
    ids=["last_fp16", "two_axes_fp16", "all_axes"])
def test_rms_normalization(shape, wshape, axis, dtype, tmp_path):
    """Every axis count is one last-axis ``R.nn.rms_norm`` (what the norm passes fuse)."""
    model = _model("RMSNormalization", {"x": (shape, dtype), "w": (wshape, dtype)}, ["y"], 23, axis=axis)
    text = _check(model, tmp_path, rtol=2e-3 if dtype == "float16" else 1e-5)
    assert len(re.findall(r"R\.nn\.rms_norm\([^)]*axes=\[\d+\]", text)) == 1 and "R.mean" not in text, text


class TwoAxisRMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm((4, 16), eps=1e-5)
        torch.nn.init.uniform_(self.norm.weight, 0.5, 1.5)

    def forward(self, x):
        return self.norm(x)


def test_torch_rms_norm_dynamo_opset23(tmp_path):
    from models.export_onnx import export_onnx

    module = TwoAxisRMSNorm().eval()
    x = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(0))
    path = export_onnx(module, (x,), tmp_path / "rms.onnx", opset=23, dynamo=True)
    assert [n.op_type for n in onnx.load(str(path)).graph.node] == ["RMSNormalization"]
    out = tvmfuse.compile(str(path), target="cpu").load()(x.numpy())
    ref = module(x).detach().numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,attrs,dtype", [
    ((2, 5, 3 * 8), {"num_heads": 3, "interleaved": 1, "rotary_embedding_dim": 4}, "float32"),
    ((2, 3, 5, 8), {"rotary_embedding_dim": 6}, "float16")], ids=["3d_interleaved_partial", "4d_fp16"])
def test_rotary_embedding(shape, attrs, dtype, tmp_path):
    half = attrs["rotary_embedding_dim"] // 2
    seq = shape[1] if len(shape) == 3 else shape[2]
    inputs = {"x": (shape, dtype), "cos": ((16, half), dtype), "sin": ((16, half), dtype),
              "pos": ((shape[0], seq), "int64")}
    _check(_model("RotaryEmbedding", inputs, ["y"], 23, **attrs), tmp_path,
           rtol=2e-3 if dtype == "float16" else 1e-5, ints=16)


def test_swish_and_swiglu_alpha(tmp_path):
    _check(_model("Swish", {"x": ((3, 7), "float32")}, ["y"], 24, alpha=0.5), tmp_path)
    model = _model("SwiGLU", {"a": ((3, 7), "float16"), "b": ((3, 7), "float16")}, ["y"], 28, alpha=1.7)
    _check(model, tmp_path, rtol=2e-3)


@pytest.mark.parametrize("attrs,write", [({"axis": -1, "mode": "circular"}, True), ({"axis": 1}, False)],
                         ids=["last_axis_circular", "no_write_indices"])
def test_tensor_scatter(attrs, write, tmp_path):
    axis = attrs["axis"]
    cache, update = [2, 6, 5, 6], [2, 6, 5, 6]
    update[axis] = 4
    inputs = {"cache": (tuple(cache), "float32"), "update": (tuple(update), "float32")}
    if write:
        inputs["idx"] = ((2,), "int64")
    _check(_model("TensorScatter", inputs, ["y"], 24, **attrs), tmp_path, ints=6)


def test_causal_conv_fp16_silu_bias_past(tmp_path):
    inputs = {"x": ((2, 5, 7), "float16"), "w": ((5, 1, 3), "float16"), "b": ((5,), "float16"),
              "past": ((2, 5, 2), "float16")}
    _check(_model("CausalConvWithState", inputs, ["y", "state"], 27, activation="silu"), tmp_path,
           rtol=2e-3)


def test_causal_conv_kernel_one_refused(tmp_path):
    model = _model("CausalConvWithState", {"x": ((2, 5, 7), "float32"), "w": ((5, 1, 1), "float32")},
                   ["y", "state"], 27)
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(UnsupportedOpError, match=r"node 'my_causalconvwithstate': op CausalConvWithState "
                                                 r"with a kernel of size 1"):
        import_model(str(tmp_path / "m.onnx"))


@pytest.mark.parametrize("rule,dtype", [("gated_delta", "float16"), ("delta", "float32"),
                                        ("linear", "float32")])
def test_linear_attention_gqa_past(rule: str, dtype: str, tmp_path):
    """Hq = 4, Hkv = 2, dk = 4, dv = 6, T = 5, a past state; decay per key dim, beta per head."""
    b, t, hq, hkv, dk, dv = 2, 5, 4, 2, 4, 6
    inputs = {"q": ((b, t, hq * dk), dtype), "k": ((b, t, hkv * dk), dtype), "v": ((b, t, hkv * dv), dtype),
              "past": ((b, hkv, dk, dv), "float32")}
    names = ["q", "k", "v", "past", "", ""]
    if rule.startswith("gated"):
        inputs["decay"], names[4] = ((b, t, hkv * dk), dtype), "decay"
    if rule.endswith("delta"):
        inputs["beta"], names[5] = ((b, t, hkv), dtype), "beta"
    model = _model("LinearAttention", inputs, ["y", "state"], 27, node_inputs=names,
                   q_num_heads=hq, kv_num_heads=hkv, update_rule=rule)
    # fp16 inputs recur in fp32 in both (the reference upcasts q, k, v, decay and beta)
    _check(model, tmp_path, rtol=2e-3 if dtype == "float16" else 1e-5)


def test_linear_attention_too_long_refused(tmp_path):
    from tvmfuse.frontend.onnx_ops.linear_attention import MAX_STEPS

    shape = ((1, MAX_STEPS + 1, 8), "float32")
    model = _model("LinearAttention", {"q": shape, "k": shape, "v": shape}, ["y", "state"], 27,
                   q_num_heads=2, kv_num_heads=2, update_rule="linear")
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(UnsupportedOpError, match=rf"node 'my_linearattention': op LinearAttention over "
                                                 rf"{MAX_STEPS + 1} positions"):
        import_model(str(tmp_path / "m.onnx"))
