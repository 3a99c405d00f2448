"""Bad input gives a clear error naming what and where; never a crash or silent wrong numbers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import tvmfuse
from tvmfuse.errors import (
    DeviceError,
    InputError,
    InputSpecError,
    LibraryError,
    ModelError,
    UnsupportedOpError,
)
from tvmfuse.frontend import parse_input_override
from tvmfuse.targets import get_target


class Small(torch.nn.Module):
    """y = tanh(x·Wᵀ) * 2, x: (2, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * 2


@pytest.fixture(scope="module")
def cpu_lib(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("lib") / "small.so"
    tvmfuse.compile(Small().eval(), (torch.randn(2, 8),), target="cpu").export(path)
    return path


def _onnx_with_unsupported(path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu0"),
        helper.make_node("FooBar", ["a"], ["b"], name="custom1", domain="acme"),
        helper.make_node("Relu", ["b"], ["c"], name="relu1"),
        helper.make_node("NoSuchOnnxOp", ["c"], ["y"], name="weird2"),
    ]
    graph = helper.make_graph(nodes, "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("acme", 1)])
    onnx.save(model, path)


def test_unsupported_onnx_ops_reported_all_at_once(tmp_path):
    path = tmp_path / "bad.onnx"
    _onnx_with_unsupported(path)
    with pytest.raises(UnsupportedOpError) as info:
        tvmfuse.compile(str(path), target="cpu")
    err = info.value
    assert err.unsupported == [("custom1", "acme::FooBar"), ("weird2", "NoSuchOnnxOp")]
    assert "custom1" in str(err) and "weird2" in str(err) and "2 node(s)" in str(err)


def test_unsupported_torch_op_names_node():
    class Odd(torch.nn.Module):
        def forward(self, x):
            return torch.special.bessel_j0(x) + torch.special.bessel_j1(x)

    with pytest.raises(UnsupportedOpError) as info:
        tvmfuse.compile(Odd(), (torch.randn(3),), target="cpu")
    ops = {op for _, op in info.value.unsupported}
    assert {"special_bessel_j0.default", "special_bessel_j1.default"} <= ops
    assert all(node for node, _ in info.value.unsupported)


def test_corrupt_onnx_file(tmp_path):
    path = tmp_path / "corrupt.onnx"
    path.write_bytes(b"\x08\x07garbage" * 10)
    with pytest.raises(ModelError, match="corrupt.onnx"):
        tvmfuse.compile(str(path), target="cpu")


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        tvmfuse.compile(str(tmp_path / "nope.onnx"), target="cpu")


def test_unknown_target():
    with pytest.raises(tvmfuse.TvmfuseError, match="unknown target 'sm70'"):
        get_target("sm70")


@pytest.mark.parametrize("text, msg", [
    ("x", "expected NAME:SHAPE"), ("x:2x1.5", "positive integers"), ("x:0x3", "positive"),
    ("x:2x3:float99", "unknown dtype"),
])
def test_bad_input_override(text, msg):
    with pytest.raises(InputSpecError, match=msg):
        parse_input_override(text)


def test_override_names_unknown_input():
    with pytest.raises(InputSpecError, match=r"\['y'\] are not model inputs"):
        tvmfuse.compile(Small(), (torch.randn(2, 8),), target="cpu", inputs=["y:2x8"])


def test_call_errors_name_the_input(cpu_lib):
    model = tvmfuse.load(cpu_lib, device="cpu")
    x = np.random.default_rng(0).standard_normal((2, 8)).astype("float32")
    with pytest.raises(InputError, match=r"input 0 'x': expected shape \[2, 8\], got \[3, 8\]"):
        model(np.zeros((3, 8), "float32") + 1)
    with pytest.raises(InputError, match="input 0 'x': expected dtype float32, got float64"):
        model(x.astype("float64"))
    with pytest.raises(InputError, match=r"missing input\(s\) \['x'\]"):
        model()
    with pytest.raises(InputError, match="2 inputs given, the library takes 1"):
        model(x, x)
    with pytest.raises(InputError, match=r"unknown input name\(s\) \['z'\]"):
        model(z=x)
    with pytest.raises(InputError, match="expected a torch.Tensor or numpy.ndarray, got list"):
        model([1.0] * 16)
    assert model(x=x).shape == (2, 8)


def test_cpu_library_on_cuda_device_is_refused(cpu_lib):
    with pytest.raises(DeviceError, match="built for target cpu"):
        tvmfuse.load(cpu_lib, device="cuda")


def test_gpu_library_on_cpu_is_refused(tmp_path):
    torch.manual_seed(0)
    path = tvmfuse.compile(Small().eval(), (torch.randn(2, 8),), target="sm90").export(
        tmp_path / "g.so")
    with pytest.raises(DeviceError, match="built for target sm90"):
        tvmfuse.load(path, device="cpu")


def test_wrong_arch_matrix():
    assert get_target("sm90").can_run_on("9.0")
    assert not get_target("sm90").can_run_on("8.0")
    assert get_target("sm80").can_run_on("8.6") and get_target("sm80").can_run_on("9.0")
    assert not get_target("sm80").can_run_on("10.0")


@pytest.mark.parametrize("corruption", ["truncate", "garbage", "not_elf"])
def test_corrupt_library(cpu_lib, tmp_path, corruption):
    data = cpu_lib.read_bytes()
    bad = tmp_path / f"{corruption}.so"
    if corruption == "truncate":
        bad.write_bytes(data[: len(data) // 3])
    elif corruption == "garbage":
        bad.write_bytes(data[:64] + bytes(len(data) - 64))
    else:
        bad.write_bytes(b"hello, I am not a library")
    with pytest.raises(LibraryError, match=f"{corruption}.so"):
        tvmfuse.load(bad, device="cpu")


def test_missing_library(tmp_path):
    with pytest.raises(LibraryError, match="does not exist"):
        tvmfuse.load(tmp_path / "none.so", device="cpu")


def test_plain_shared_library_is_not_tvmfuse(tmp_path):
    import ctypes.util

    libm = ctypes.util.find_library("m")
    import shutil
    import subprocess

    src = tmp_path / "plain.c"
    src.write_text("int f(void) { return 1; }\n")
    out = tmp_path / "plain.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    assert libm or shutil.which("gcc")
    with pytest.raises(LibraryError, match="not a tvmfuse library"):
        tvmfuse.load(out, device="cpu")


def test_fast_and_checked_call_paths_agree(cpu_lib):
    """Positional contiguous torch inputs take the fast path; views, numpy and kwargs the checked
    path; all give the same numbers, and the fast path still refuses a wrong dtype or shape."""
    torch.manual_seed(1)
    model = tvmfuse.load(cpu_lib, device="cpu")
    x = torch.randn(2, 8)
    fast = model(x)
    assert isinstance(fast, torch.Tensor)
    strided = torch.randn(8, 2).t()  # non-contiguous view of the same shape
    strided.copy_(x)
    name = model.inputs[0]["name"]
    for other in (model(**{name: x}), model(strided), torch.from_numpy(model(x.numpy()))):
        torch.testing.assert_close(other, fast)
    with pytest.raises(InputError, match="dtype"):
        model(x.double())
    with pytest.raises(InputError, match="shape"):
        model(torch.randn(3, 8))
