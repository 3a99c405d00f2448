"""Classic ONNX converters (tvmfuse/frontend/onnx_ops) on cases the ONNX node tests miss, compared
with numpy / onnxruntime on random inputs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import tvmfuse


def _model(node, inputs, outputs, inits=(), opset=21):
    graph = helper.make_graph([node], "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _run(model, *args):
    out = tvmfuse.compile(model, target="cpu").load("cpu")(*args)
    return [np.asarray(o) for o in out] if isinstance(out, tuple | list) else [np.asarray(out)]


def test_int_pow_wraps_and_negative_exponents():
    """int64 ** int64 wraps modulo 2^64 like numpy; a negative exponent gives 1 / ±1 / 0."""
    node = helper.make_node("Pow", ["x", "y"], ["z"])
    vi = [helper.make_tensor_value_info(n, TensorProto.INT64, [6]) for n in "xyz"]
    model = _model(node, vi[:2], vi[2:], opset=15)
    x = np.array([3, -2, 7, 1, -1, 5], np.int64)
    y = np.array([41, 63, 5, -3, -3, -1], np.int64)
    with np.errstate(over="ignore"):
        want = np.power(x, np.maximum(y, 0))
    want[3:] = [1, -1, 0]
    np.testing.assert_array_equal(_run(model, x, y)[0], want)


@pytest.mark.parametrize("inverse,onesided,length", [(0, 0, 12), (0, 1, 7), (1, 0, 9), (1, 1, 10)])
def test_dft_against_numpy(inverse, onesided, length):
    """dft_length padding / truncation, complex input, axis 2 of a 4-D signal."""
    complex_in = not onesided or inverse
    shape = [2, 3, 8 if not (inverse and onesided) else 6, 2 if complex_in else 1]
    node = helper.make_node("DFT", ["x", "n", ""], ["y"], inverse=inverse, onesided=onesided)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [helper.make_tensor("n", TensorProto.INT64, [], [length])], opset=19)
    model.graph.node[0].attribute.append(helper.make_attribute("axis", 2))
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    sig = x[..., 0] + 1j * x[..., 1] if complex_in else x[..., 0]
    if inverse and onesided:
        want = np.fft.irfft(sig, n=length, axis=2)[..., None]
    else:
        f = (np.fft.ifft if inverse else np.fft.fft)(sig, n=length, axis=2)
        if onesided:
            f = f[:, :, : length // 2 + 1]
        want = np.stack([f.real, f.imag], -1)
    np.testing.assert_allclose(_run(model, x)[0], want, rtol=1e-4, atol=1e-4)


def test_hann_window_runtime_size():
    """One library, two sizes: the window length is data-dependent."""
    node = helper.make_node("HannWindow", ["n"], ["w"], periodic=0)
    model = _model(node, [helper.make_tensor_value_info("n", TensorProto.INT64, [])],
                   [helper.make_tensor_value_info("w", TensorProto.FLOAT, None)], opset=17)
    run = tvmfuse.compile(model, target="cpu").load("cpu")
    for n in (5, 12):
        np.testing.assert_allclose(np.asarray(run(np.array(n, np.int64))), np.hanning(n), atol=1e-6)


def test_qlinearconv_per_channel_against_onnxruntime():
    """Per-output-channel weight scale / zero point, bias, stride and padding; ties round to even."""
    rng = np.random.default_rng(2)
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"],
                            pads=[1, 1, 1, 1], strides=[2, 1])
    inits = [helper.make_tensor("xs", TensorProto.FLOAT, [], [0.05]),
             helper.make_tensor("xz", TensorProto.UINT8, [], [120]),
             helper.make_tensor("w", TensorProto.INT8, [4, 3, 3, 3], rng.integers(-60, 60, 108).tolist()),
             helper.make_tensor("ws", TensorProto.FLOAT, [4], [0.01, 0.02, 0.005, 0.03]),
             helper.make_tensor("wz", TensorProto.INT8, [4], [0, 0, 0, 0]),
             helper.make_tensor("ys", TensorProto.FLOAT, [], [0.1]),
             helper.make_tensor("yz", TensorProto.UINT8, [], [128]),
             helper.make_tensor("b", TensorProto.INT32, [4], [100, -50, 7, 0])]
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 3, 9, 7])],
                   [helper.make_tensor_value_info("y", TensorProto.UINT8, None)], inits, opset=10)
    x = rng.integers(0, 255, (1, 3, 9, 7)).astype(np.uint8)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(_run(model, x)[0], want)


def test_reverse_sequence_time_major_3d():
    node = helper.make_node("ReverseSequence", ["x", "lens"], ["y"], batch_axis=1, time_axis=0)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 3, 2]),
                          helper.make_tensor_value_info("lens", TensorProto.INT64, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=10)
    x = np.random.default_rng(3).standard_normal((5, 3, 2)).astype(np.float32)
    lens = np.array([5, 1, 3], np.int64)
    want = x.copy()
    for b, n in enumerate(lens):
        want[:n, b] = x[:n, b][::-1]
    np.testing.assert_array_equal(_run(model, x, lens)[0], want)
