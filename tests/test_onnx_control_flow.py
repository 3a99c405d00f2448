"""ONNX ``Scan`` and ``Loop`` unrolled by the node loop (onnx_ops/scan.py, onnx_ops/loop.py):
numerics against onnxruntime on random inputs, and the forms that cannot be unrolled refused
naming the node and op."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import tvmfuse
from tvmfuse.errors import UnsupportedOpError

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _info(name: str, dtype: int = F, shape=None):
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(nodes, inputs, outputs, opset: int = 17, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _check(model, *arrays) -> None:
    """tvmfuse's outputs equal onnxruntime's (float tolerance)."""
    got = tvmfuse.compile(model, target="cpu").load("cpu")(*arrays)
    got = list(got) if isinstance(got, tuple) else [got]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {i.name: a for i, a in zip(sess.get_inputs(), arrays)})
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)


def _rand(*shape: int) -> np.ndarray:
    return np.random.default_rng(len(shape) + sum(shape)).standard_normal(shape).astype("float32")


def _scan_body():
    """state' = tanh(state * w + x_t) (w from the outer scope), y_t = state' + x_t."""
    nodes = [helper.make_node("Mul", ["s_in", "w"], ["sw"]),
             helper.make_node("Add", ["sw", "x_t"], ["pre"]),
             helper.make_node("Tanh", ["pre"], ["s_out"]),
             helper.make_node("Add", ["s_out", "x_t"], ["y_t"])]
    return helper.make_graph(nodes, "body", [_info("s_in", F, [3]), _info("x_t", F, [3])],
                             [_info("s_out", F, [3]), _info("y_t", F, [3])])


@pytest.mark.parametrize("in_axis,in_dir,out_axis,out_dir", [(0, 0, 0, 0), (1, 1, -1, 1), (-1, 0, 1, 0)])
def test_scan_axes_and_directions(in_axis: int, in_dir: int, out_axis: int, out_dir: int):
    x_shape = [5, 3] if in_axis == 0 else [3, 5]
    scan = helper.make_node("Scan", ["s0", "x"], ["s", "y"], body=_scan_body(), num_scan_inputs=1,
                            scan_input_axes=[in_axis], scan_input_directions=[in_dir],
                            scan_output_axes=[out_axis], scan_output_directions=[out_dir])
    w = helper.make_tensor("w", F, [3], [0.5, -1.0, 2.0])
    model = _model([scan], [_info("s0", F, [3]), _info("x", F, x_shape)],
                   [_info("s", F, [3]), _info("y", F, None)], initializers=[w])
    _check(model, _rand(3), _rand(*x_shape))


def test_scan_opset8_batched():
    scan = helper.make_node("Scan", ["", "s0", "x"], ["s", "y"], body=_scan_body(),
                            num_scan_inputs=1, directions=[1])
    w = helper.make_tensor("w", F, [3], [0.5, -1.0, 2.0])
    model = _model([scan], [_info("s0", F, [2, 3]), _info("x", F, [2, 4, 3])],
                   [_info("s", F, [2, 3]), _info("y", F, [2, 4, 3])], opset=8, initializers=[w])
    _check(model, _rand(2, 3), _rand(2, 4, 3))


def test_scan_dynamic_length_is_refused():
    scan = helper.make_node("Scan", ["s0", "x"], ["s", "y"], name="the_scan", body=_scan_body(),
                            num_scan_inputs=1)
    w = helper.make_tensor("w", F, [3], [0.5, -1.0, 2.0])
    model = _model([scan], [_info("s0", F, [3]), _info("x", F, ["T", 3])],
                   [_info("s", F, [3]), _info("y", F, None)], initializers=[w])
    with pytest.raises(UnsupportedOpError, match=r"the_scan.*Scan.*dynamic shape"):
        tvmfuse.compile(model, target="cpu", dynamic={"T": (1, 8)})


def _loop_body(*cond_nodes):
    """v' = v * 0.5 + x[i] (x from the outer scope), y_i = v'; cond' from ``cond_nodes``."""
    nodes = [*cond_nodes,
             helper.make_node("Gather", ["x", "i"], ["x_i"], axis=0),
             helper.make_node("Mul", ["v_in", "half"], ["vh"]),
             helper.make_node("Add", ["vh", "x_i"], ["v_out"]),
             helper.make_node("Identity", ["v_out"], ["y"])]
    return helper.make_graph(nodes, "body", [_info("i", I64, []), _info("c_in", B, []),
                                             _info("v_in", F, [3])],
                             [_info("c_out", B, []), _info("v_out", F, [3]), _info("y", F, [3])])


def _loop_model(body, trip: int | None, name: str = "loop"):
    consts = [helper.make_tensor("half", F, [], [0.5]), helper.make_tensor("yes", B, [], [True]),
              helper.make_tensor("two", I64, [], [2])]
    inputs = [_info("x", F, [6, 3]), _info("v0", F, [3])]
    if trip is None:
        inputs.append(_info("m", I64, []))
    else:
        consts.append(helper.make_tensor("m", I64, [], [trip]))
    loop = helper.make_node("Loop", ["m", "yes", "v0"], ["v", "ys"], name=name, body=body)
    return _model([loop], inputs, [_info("v", F, [3]), _info("ys", F, None)], initializers=consts)


def test_loop_constant_trip_count():
    body = _loop_body(helper.make_node("Identity", ["c_in"], ["c_out"]))
    _check(_loop_model(body, 5), _rand(6, 3), _rand(3))


def test_loop_condition_from_the_counter_stops_early():
    body = _loop_body(helper.make_node("Less", ["i", "two"], ["c_out"]))  # runs i = 0, 1, 2
    _check(_loop_model(body, 6), _rand(6, 3), _rand(3))


def test_loop_runtime_condition_is_refused():
    body = _loop_body(helper.make_node("ReduceMax", ["v_in"], ["c_f"], keepdims=0),  # data-dependent
                      helper.make_node("Cast", ["c_f"], ["c_out"], to=B))
    with pytest.raises(UnsupportedOpError, match=r"my_loop.*Loop body output cond is a runtime"):
        tvmfuse.compile(_loop_model(body, 4, "my_loop"), target="cpu")


class _Recurrence(torch.nn.Module):
    """A user's scripted recurrence over the sequence axis (the legacy exporter writes a Loop)."""

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        for i in range(x.size(1)):
            h = torch.tanh(x[:, i] + h * 0.5)
        return h


def test_torch_scripted_loop_legacy_export():
    x, h = torch.randn(2, 4, 3), torch.randn(2, 3)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch.jit.script(_Recurrence()), (x, h), buffer, dynamo=False, opset_version=17)
    model = onnx.load_from_string(buffer.getvalue())
    assert any(n.op_type == "Loop" for n in model.graph.node)
    got = tvmfuse.compile(model, target="cpu").load("cpu")(x.numpy(), h.numpy())
    np.testing.assert_allclose(np.asarray(got), _Recurrence()(x, h).numpy(), rtol=1e-5, atol=1e-5)


def _induction_model(dtype: int, shape: list[int], step_shape: list[int], after_step: bool):
    """Loop(M, cond, v0) with v' = v + step (step a graph input), y_i = v (or v'); M, cond runtime."""
    nodes = [helper.make_node("Identity", ["c_in"], ["c_out"]),
             helper.make_node("Add", ["step", "v_in"], ["v_out"]),
             helper.make_node("Identity", ["v_out" if after_step else "v_in"], ["y"])]
    body = helper.make_graph(nodes, "body", [_info("i", I64, []), _info("c_in", B, []),
                                             _info("v_in", dtype, shape)],
                             [_info("c_out", B, []), _info("v_out", dtype, shape), _info("y", dtype, None)])
    loop = helper.make_node("Loop", ["m", "cond", "v0"], ["v", "ys"], body=body)
    inputs = [_info("m", I64, []), _info("cond", B, []), _info("v0", dtype, shape),
              _info("step", dtype, step_shape)]
    return _model([loop], inputs, [_info("v", dtype, shape), _info("ys", dtype, None)])


@pytest.mark.parametrize("m,cond", [(5, True), (1, True), (4, False)])
def test_loop_runtime_trip_count_induction_float(m: int, cond: bool):
    model = _induction_model(F, [2, 3], [], after_step=False)
    _check(model, np.array(m, "int64"), np.array(cond), _rand(2, 3), np.array(0.75, "float32"))


def test_loop_runtime_trip_count_induction_int_after_step():
    model = _induction_model(TensorProto.INT32, [3], [3], after_step=True)
    _check(model, np.array(6, "int64"), np.array(True), np.array([1, -4, 7], "int32"),
           np.array([-3, 2, 5], "int32"))


def test_loop_runtime_trip_count_other_body_is_refused():
    body = _loop_body(helper.make_node("Identity", ["c_in"], ["c_out"]))  # gathers x[i]: no closed form
    with pytest.raises(UnsupportedOpError, match=r"my_loop.*Loop input M \(trip count\) is a runtime"):
        tvmfuse.compile(_loop_model(body, None, "my_loop"), target="cpu")
