"""SingleThread: sequential kernels (te.extern, no thread-bound loop) on one GPU thread.

Before the rule, such a kernel (ONNX Det, NonMaxSuppression) was built for a CUDA target as a
host function that dereferenced device pointers: NMS segfaulted on the H200 and a Det-only model
failed export with "no CUDA module".
"""

from __future__ import annotations

import re

import pytest
import tvm
from onnx import TensorProto, helper
from tvm import te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

import tvmfuse
from tests.cuda_tools import needs_nvcc
from tvmfuse.build.inspect import cuda_source
from tvmfuse.rules import SingleThread
from tvmfuse.targets import get_target

SM90 = get_target("sm90").tvm_target()


def _extern_sum(ins, outs):
    with IRBuilder() as builder:
        x, y = T.buffer_proxy(ins[0]), T.buffer_proxy(outs[0])
        with T.serial(0, 1):  # one frame around the statements
            y[0] = tirx.const(0.0, "float32")
            with T.serial(0, 16) as i:
                y[0] = y[0] + x[i]
    return builder.get()


def _sequential() -> tirx.PrimFunc:
    """y[0] = Σ x written as sequential code (an extern kernel, like NMS / Det)."""
    x = te.placeholder((16,), "float32", name="x")
    y = te.extern([(1,)], [x], _extern_sum, name="running_sum", dtype="float32")
    return te.create_prim_func([x, y])


def test_launches_one_thread():
    sch = SingleThread().apply(_sequential(), SM90, False)
    assert sch is not None
    func = sch.mod["main"]
    text = func.script()
    bound = r"T\.thread_binding\((?:T\.int\d+\()?1\)?, thread=\"(?:blockIdx|threadIdx)\.x\""
    assert len(re.findall(bound, text)) == 2
    assert func.attrs["tvmfuse.rule"] == "single_thread"
    assert "thread_binding" not in _sequential().script()


def test_not_for_cpu_or_bound_kernels():
    assert SingleThread().apply(_sequential(), tvm.target.Target("llvm"), False) is None
    bound = SingleThread().apply(_sequential(), SM90, False).mod["main"]
    assert SingleThread().apply(bound, SM90, False) is None


def _det_model():
    node = helper.make_node("Det", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


@needs_nvcc
def test_det_builds_a_device_kernel(tmp_path):
    """A Det-only model has a GPU kernel (it had none: the sequential kernel was a host function)."""
    lib = tvmfuse.compile(_det_model(), target="sm90")
    source = cuda_source(lib.executable)
    assert source is not None and "__global__" in source
    lib.export(tmp_path / "det.so")


@pytest.mark.gpu
def test_det_on_gpu(tmp_path):
    import numpy as np
    import torch

    x = np.random.default_rng(0).standard_normal((3, 4, 4)).astype("float32")
    lib = tvmfuse.compile(_det_model(), target="sm90")
    got = lib.load("cuda", workdir=tmp_path)(torch.from_numpy(x).cuda()).cpu().numpy()
    np.testing.assert_allclose(got, np.linalg.det(x.astype("float64")), rtol=1e-4, atol=1e-5)
