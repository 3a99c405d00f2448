"""ONNX RNN / GRU / LSTM converters: user-exported torch modules and ONNX-only cases vs onnxruntime."""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import tvmfuse


class _Seq(torch.nn.Module):
    def __init__(self, cell: str):
        super().__init__()
        cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[cell]
        self.rnn = cls(input_size=6, hidden_size=5, num_layers=2, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(10, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_torch_module_legacy_export(cell):
    torch.manual_seed(0)
    model = _Seq(cell).eval()
    x = torch.randn(2, 7, 6)
    buf = io.BytesIO()
    torch.onnx.export(model, (x,), buf, dynamo=False, input_names=["x"])
    run = tvmfuse.compile(onnx.load_from_string(buf.getvalue()), target="cpu").load("cpu")
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(np.asarray(run(x.numpy())), want, rtol=1e-4, atol=1e-5)


def _model(op: str, direction: str, hidden: int, inputs: int, gates: int, **attrs):
    names = ["X", "W", "R", "B", "sequence_lens", "initial_h"]
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, names, outs, hidden_size=hidden, direction=direction, **attrs)
    d = 2 if direction == "bidirectional" else 1
    seq, batch = 4, 3
    shapes = {"X": [seq, batch, inputs], "W": [d, gates * hidden, inputs],
              "R": [d, gates * hidden, hidden], "B": [d, 2 * gates * hidden],
              "initial_h": [d, batch, hidden]}
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in names if n in shapes]
    ins.insert(4, helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, [batch]))
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                 for o in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal(s).astype(np.float32) * 0.5 for n, s in shapes.items()}
    feeds["sequence_lens"] = np.array([4, 2, 1], dtype=np.int32)
    return model, [feeds[n] for n in names]


@pytest.mark.parametrize("op,gates,attrs", [("RNN", 1, {}), ("GRU", 3, {"linear_before_reset": 1}),
                                            ("GRU", 3, {}), ("LSTM", 4, {"clip": 0.7})])
def test_sequence_lens_against_onnxruntime(op, gates, attrs):
    """Rows shorter than the sequence: masked steps keep the state and give Y = 0 (bidirectional:
    the reverse direction starts a short row at its own last step)."""
    model, feeds = _model(op, "bidirectional", 5, 3, gates, **attrs)
    names = [i.name for i in model.graph.input]
    want = ort.InferenceSession(model.SerializeToString()).run(None, dict(zip(names, feeds)))
    got = tvmfuse.compile(model, target="cpu").load("cpu")(*feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5)


def test_activation_alpha_refused():
    model, _ = _model("RNN", "forward", 5, 3, 1, activations=["LeakyRelu"], activation_alpha=[0.2])
    with pytest.raises(tvmfuse.errors.UnsupportedOpError, match="RNN attribute activation_alpha"):
        tvmfuse.compile(model, target="cpu")
