"""ONNX frontend on CPU: the example models exported to ONNX, hand-built single-op graphs and
dynamic input dims, each compiled for target "cpu" and compared with onnxruntime in fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import tvmfuse

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `models` lives at the repo root, next to tests/
    sys.path.insert(0, str(REPO_ROOT))

from models import decoder_layer, mlp_block  # noqa: E402
from models.export_onnx import export_onnx  # noqa: E402

RTOL = 1e-4  # fp32: ||out - ref|| / ||ref||
OPSET = 17

MODEL_BUILDS = {
    "mlp_block": lambda: mlp_block.build(batch=2, seq=8, hidden=32),
    "decoder_layer": lambda: decoder_layer.build(batch=2, seq=8, hidden=32, n_heads=4, n_kv_heads=2),
}


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, f"shape {out.shape} != reference {ref.shape}"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def run_and_compare(lib, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Run the compiled library and onnxruntime (``lib.model.reference``) on ``inputs``."""
    out = lib.load()(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    refs = lib.model.reference(*inputs)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert isinstance(o, np.ndarray), "numpy inputs must give numpy outputs"
        assert o.dtype == r.dtype
        assert np.isfinite(o).all()
        err = rel_err(o, r)
        assert err <= RTOL, f"relative error {err:.3e} > {RTOL}"
    return outs


def random_inputs(lib, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s.shape).astype(s.dtype) for s in lib.model.inputs]


# --- the example models, exported ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODEL_BUILDS))
def test_model_torchscript_export(name, tmp_path):
    module, (x,) = MODEL_BUILDS[name]()
    path = export_onnx(module, (x,), tmp_path / f"{name}.onnx", dynamo=False)
    lib = tvmfuse.compile(str(path), target="cpu")
    assert [(s.name, s.shape, s.dtype) for s in lib.model.inputs] == [
        ("x", tuple(x.shape), "float32")
    ]
    assert lib.model.output_names == ["y"]
    run_and_compare(lib, random_inputs(lib))
    # The ONNX graph still computes what the torch module does.
    with torch.no_grad():
        ref = module(x).numpy()
    assert rel_err(lib.load()(x.numpy()), ref) <= RTOL


def test_decoder_dynamo_export(tmp_path):
    # The dynamo exporter emits a different graph (opset 18, folded RoPE/mask, Reciprocal).
    module, (x,) = MODEL_BUILDS["decoder_layer"]()
    path = export_onnx(module, (x,), tmp_path / "decoder.onnx", dynamo=True)
    lib = tvmfuse.compile(str(path), target="cpu")
    run_and_compare(lib, random_inputs(lib))
    with torch.no_grad():
        ref = module(x).numpy()
    assert rel_err(lib.load()(x.numpy()), ref) <= RTOL


def test_mlp_dynamic_batch_export(tmp_path):
    module, (x,) = MODEL_BUILDS["mlp_block"]()
    path = export_onnx(module, (x,), tmp_path / "mlp.onnx", dynamic_batch=True)
    with pytest.raises(tvmfuse.InputSpecError, match=r"'x'.*batch"):
        tvmfuse.compile(str(path), target="cpu")
    # A batch size other than the exported one.
    lib = tvmfuse.compile(str(path), target="cpu", inputs={"x": (3, *x.shape[1:])})
    assert lib.model.inputs[0].shape == (3, *x.shape[1:])
    run_and_compare(lib, random_inputs(lib))


# --- hand-built graphs -------------------------------------------------------------------------------


def make_model(nodes, inputs, outputs, initializers=(), opset: int = OPSET) -> onnx.ModelProto:
    """``inputs``/``outputs``: (name, shape) float32 tensors; ``initializers``: (name, array)."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(np.asarray(a), name=n) for n, a in initializers],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _w(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _matmul_add_relu():
    return make_model(
        [helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("Add", ["h", "b"], ["a"]),
         helper.make_node("Relu", ["a"], ["y"])],
        [("x", [4, 16])], [("y", [4, 8])],
        [("w", _w(16, 8)), ("b", _w(8, seed=1))],
    )


def _gelu_erf():
    # y = x * 0.5 * (1 + erf(x / sqrt(2))), the form exporters write for exact GELU.
    return make_model(
        [helper.make_node("Div", ["x", "sqrt2"], ["d"]),
         helper.make_node("Erf", ["d"], ["e"]),
         helper.make_node("Add", ["e", "one"], ["p"]),
         helper.make_node("Mul", ["x", "p"], ["m"]),
         helper.make_node("Mul", ["m", "half"], ["y"])],
        [("x", [3, 5, 7])], [("y", [3, 5, 7])],
        [("sqrt2", np.float32(np.sqrt(2.0))), ("one", np.float32(1.0)), ("half", np.float32(0.5))],
    )


def _softmax():
    return make_model(
        [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [("x", [2, 3, 9])], [("y", [2, 3, 9])]
    )


def _softmax_axis1():
    return make_model(
        [helper.make_node("Softmax", ["x"], ["y"], axis=1)], [("x", [2, 5, 3])], [("y", [2, 5, 3])]
    )


def _layer_norm():
    return make_model(
        [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=-1,
                          epsilon=1e-5)],
        [("x", [2, 5, 16])], [("y", [2, 5, 16])],
        [("scale", 1.0 + 0.2 * _w(16, seed=2)), ("bias", _w(16, seed=3))],
    )


def _transpose_reshape():
    # (2, 5, 16) -> (2, 5, 4, 4) -> (2, 4, 5, 4) -> (2, 4, 20): the head split of attention.
    return make_model(
        [helper.make_node("Reshape", ["x", "s1"], ["r"]),
         helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
         helper.make_node("Reshape", ["t", "s2"], ["y"])],
        [("x", [2, 5, 16])], [("y", [2, 4, 20])],
        [("s1", np.array([2, 5, 4, 4], np.int64)), ("s2", np.array([0, 4, -1], np.int64))],
    )


def _matmul_batched_softmax():
    # Attention scores: softmax(Q · Kᵀ), Q and K both graph inputs.
    return make_model(
        [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
         helper.make_node("MatMul", ["q", "kt"], ["s"]),
         helper.make_node("Softmax", ["s"], ["y"], axis=-1)],
        [("q", [2, 3, 5, 8]), ("k", [2, 3, 6, 8])], [("y", [2, 3, 5, 6])],
    )


def _trilu_mask_softmax():
    # Causal masking as the TorchScript exporter writes it: Trilu on a -inf matrix, then Add.
    return make_model(
        [helper.make_node("Trilu", ["ninf", "k"], ["m"], upper=1),  # -inf where col >= row + 1
         helper.make_node("Add", ["x", "m"], ["s"]),
         helper.make_node("Softmax", ["s"], ["y"], axis=-1)],
        [("x", [2, 6, 6])], [("y", [2, 6, 6])],
        [("ninf", np.full((6, 6), -np.inf, np.float32)), ("k", np.int64(1))],
    )


GRAPHS = {
    "matmul_add_relu": _matmul_add_relu,
    "gelu_erf": _gelu_erf,
    "softmax": _softmax,
    "softmax_axis1": _softmax_axis1,
    "layer_norm": _layer_norm,
    "transpose_reshape": _transpose_reshape,
    "matmul_batched_softmax": _matmul_batched_softmax,
    "trilu_mask_softmax": _trilu_mask_softmax,
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_graph(name, tmp_path):
    path = tmp_path / f"{name}.onnx"
    onnx.save(GRAPHS[name](), path)
    lib = tvmfuse.compile(str(path), target="cpu")
    run_and_compare(lib, random_inputs(lib))


def test_graph_from_model_proto():
    lib = tvmfuse.compile(_matmul_add_relu(), target="cpu")
    outs = run_and_compare(lib, random_inputs(lib, seed=5))
    assert (outs[0] >= 0).all() and (outs[0] > 0).any()


# --- dynamic dims --------------------------------------------------------------------------------


def _dynamic_batch_model() -> onnx.ModelProto:
    return make_model(
        [helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("Add", ["h", "b"], ["a"]),
         helper.make_node("Softmax", ["a"], ["y"], axis=-1)],
        [("x", ["batch", 8])], [("y", ["batch", 8])],
        [("w", _w(8, 8)), ("b", _w(8, seed=1))],
    )


def test_dynamic_dim_needs_input_spec(tmp_path):
    path = tmp_path / "dyn.onnx"
    onnx.save(_dynamic_batch_model(), path)
    with pytest.raises(tvmfuse.InputSpecError) as info:
        tvmfuse.compile(str(path), target="cpu")
    message = str(info.value)
    assert "'x'" in message, message
    assert "batch" in message, message


def test_dynamic_dim_with_input_spec(tmp_path):
    path = tmp_path / "dyn.onnx"
    onnx.save(_dynamic_batch_model(), path)
    lib = tvmfuse.compile(str(path), target="cpu", inputs=["x:2x8"])
    assert [(s.name, s.shape, s.dtype) for s in lib.model.inputs] == [("x", (2, 8), "float32")]
    assert lib.outputs[0].shape == (2, 8)
    run_and_compare(lib, random_inputs(lib))


def test_shape_gather_after_range():
    """Shape arithmetic after a Range: TVM 0.27 alone fails at Gather of Shape of the Add
    ('shape_of expects a tensor input'); the importer folds the static shape chain to constants
    (as in the TorchScript export of DecoderLayer at node /self_attn/Gather_4)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["n"], axis=0),
        helper.make_node("Range", ["zero", "n", "step"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "rf"], ["a"]),
        helper.make_node("Shape", ["a"], ["s2"]),
        helper.make_node("Gather", ["s2", "zero"], ["b"], axis=0),
        helper.make_node("Cast", ["b"], ["bf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["a", "bf"], ["y"]),
    ]
    ints = [("zero", np.int64(0)), ("one", np.int64(1)), ("step", np.int64(1))]
    model = make_model(nodes, [("x", [2, 4])], [("y", [2, 4])], ints)
    lib = tvmfuse.compile(model, target="cpu")
    run_and_compare(lib, random_inputs(lib))


@pytest.mark.parametrize(("index", "axis"), [(np.int64(-1), 1), (np.array([2, -4, 0], np.int64), 0),
                                           (np.array([[1], [-2]], np.int32), -1)])
def test_gather_of_constant_index_is_a_constant_take(index, axis):
    """``Gather`` of a tensor with a static extent at a constant index (negative ones wrapped at
    import): a ``take`` of a constant, without TVM's run-time ``where(i < 0, i + shape_of(x)[a],
    i)``, which the graph passes cannot read (torch's MultiheadAttention picks q, k, v that way)."""
    from tvmfuse.frontend import import_model

    nodes = [helper.make_node("Gather", ["x", "i"], ["y"], axis=axis)]
    shape = [4, 3, 5]
    out = list(np.take(np.zeros(shape), index, axis=axis).shape)
    model = make_model(nodes, [("x", shape)], [("y", out)], [("i", index)])
    text = import_model(model).mod["main"].script()
    assert "R.take" in text and "shape_of" not in text and "R.where" not in text, text
    lib = tvmfuse.compile(model, target="cpu")
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(lib.load(device="cpu")(x)), np.take(x, index, axis=axis))


def test_gather_out_of_range_constant_keeps_the_run_time_wrap():
    """An index outside the extent is not rewritten: TVM's converter handles it as before."""
    from tvmfuse.frontend import import_model

    nodes = [helper.make_node("Gather", ["x", "i"], ["y"], axis=0)]
    model = make_model(nodes, [("x", [4, 3])], [("y", [3])], [("i", np.int64(-5))])
    assert "shape_of" in import_model(model).mod["main"].script()


def _reduce_sum_model(axes_initializer: bool) -> onnx.ModelProto:
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="sum0", keepdims=0)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])]
    inits = [numpy_helper.from_array(np.array([1], np.int64), "axes")] if axes_initializer else []
    if not axes_initializer:
        inputs.append(helper.make_tensor_value_info("axes", TensorProto.INT64, [1]))
    graph = helper.make_graph([node], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_runtime_shape_like_input_is_refused_by_name(capsys):
    """SplitToSequence's split as a graph input: refused naming the node, the op and the input,
    with no "Error converting operator" noise from TVM's importer on stdout."""
    node = helper.make_node("SplitToSequence", ["x", "split"], ["seq"], name="split0")
    pick = helper.make_node("SequenceAt", ["seq", "zero"], ["y"])
    graph = helper.make_graph(
        [node, pick], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
                            helper.make_tensor_value_info("split", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(0, np.int64), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(tvmfuse.errors.UnsupportedOpError) as err:
        tvmfuse.compile(model, target="cpu")
    text = str(err.value)
    assert "'split0'" in text and "SplitToSequence input split ('split')" in text
    assert "Error converting operator" not in capsys.readouterr().out


def test_runtime_axes_follow_the_call():
    """ReduceSum's axes as a graph input: one library, the axes read at every call."""
    x = _w(3, 4)
    run = tvmfuse.compile(_reduce_sum_model(axes_initializer=False), target="cpu").load(device="cpu")
    for axis in (1, 0, -2):
        out = run(x, np.array([axis], np.int64))
        np.testing.assert_allclose(np.asarray(out), x.sum(axis=axis), rtol=1e-5, atol=1e-6)


def test_constant_shape_like_input_compiles():
    x = _w(3, 4)
    model = _reduce_sum_model(axes_initializer=True)
    out = tvmfuse.compile(model, target="cpu").load(device="cpu")(x)
    np.testing.assert_allclose(np.asarray(out), x.sum(axis=1), rtol=1e-5, atol=1e-6)


def test_converter_failure_prints_nothing(capsys):
    """A converter that fails (Reshape to an impossible shape) becomes a ModelError naming the node;
    TVM's own "Error converting operator" print is swallowed."""
    node = helper.make_node("Reshape", ["x", "s"], ["y"], name="bad_reshape")
    model = make_model([node], [("x", [3, 4])], [("y", [5, 5])],
                       [("s", np.array([5, 5], np.int64))])
    with pytest.raises(tvmfuse.errors.ModelError, match="bad_reshape"):
        tvmfuse.compile(model, target="cpu")
    assert "Error converting operator" not in capsys.readouterr().out
