"""GuardedGEMV: dlight's GEMV, except reductions of ≤ 64 elements, which get dlight's Fallback.

On the H200, dlight's two-stage GEMV schedule of ONNX CausalConvWithState's decode step (a
grouped conv1d, output (2, 4, 1), 4 taps) mapped (batch, channel) to threads differently in its
two stages and answered 0.69 off; the serial schedule has one stage.
"""

from __future__ import annotations

import pytest
import tvm
from onnx import TensorProto, helper
from tvm import te

from tvmfuse.frontend import import_model
from tvmfuse.pipeline import build, lower
from tvmfuse.rules import GuardedGEMV
from tvmfuse.rules.guarded_gemv import TINY, reduction_length
from tvmfuse.targets import get_target

SM90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host={"kind": "llvm"})


def _gemv(n: int, k: int):
    """y[i] = Σ_k W[i, k] x[k]."""
    x = te.placeholder((k,), "float32", name="x")
    w = te.placeholder((n, k), "float32", name="w")
    r = te.reduce_axis((0, k), name="r")
    y = te.compute((n,), lambda i: te.sum(w[i, r] * x[r], axis=r), name="y")
    return te.create_prim_func([x, w, y])


def test_reduction_length():
    assert reduction_length(_gemv(256, 4)) == 4
    assert reduction_length(_gemv(256, 4096)) == 4096
    x = te.placeholder((8,), "float32", name="x")
    assert reduction_length(te.create_prim_func([x, te.compute((8,), lambda i: x[i] + 1)])) is None


def _rf_buffers(sch) -> bool:
    """Whether the schedule keeps per-thread partial sums (dlight GEMV's first stage)."""
    return "_rf_local" in sch.mod["main"].script()


@pytest.mark.parametrize("k, two_stage", [(4, False), (TINY, False), (4096, True)])
def test_tiny_reductions_get_the_serial_schedule(k, two_stage):
    with SM90:
        sch = GuardedGEMV().apply(_gemv(256, k), SM90, False)
    assert sch is not None
    assert _rf_buffers(sch) == two_stage


def test_causal_conv_decode_step_is_serial():
    """The ONNX decode step's conv kernel (built for sm90): no two-stage reduction left."""
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 4]),
                                            helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 1, 4]),
                                            helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    spec = get_target("sm90")
    seen: dict[str, tvm.IRModule] = {}
    lowered = lower(import_model(model, None, {}, {}).mod, spec, None,
                    on_stage=lambda name, m: seen.__setitem__(name, m))
    build(lowered, spec)  # and through CUDA codegen
    convs = [f for gv, f in seen["schedule"].functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and "conv1d" in gv.name_hint]
    assert convs and all("_rf_local" not in f.script() for f in convs)
