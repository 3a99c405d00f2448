"""HalfNormOneKernel: astype(norm(astype(x, f32), params32), half) becomes one half-in/half-out kernel."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tests.relax_util import assert_same_numerics
from tvmfuse.passes.norm_half_io import HalfNormOneKernel


def _half_norm(norm: str, dtype: str, extra_use: bool) -> tvm.IRModule:
    """x (8, 64) half → astype f32 → norm with fp32 constants → astype half [+ the fp32 norm reused]."""
    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 64), dtype))
    g, b = (relax.const(rng.standard_normal(64).astype("float32")) for _ in range(2))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.astype(x, "float32"))
            n = bb.emit(relax.op.nn.rms_norm(a, g, axes=[-1], epsilon=1e-6) if norm == "rms"
                        else relax.op.nn.layer_norm(a, g, b, axes=[-1], epsilon=1e-5))
            y = bb.emit(relax.op.astype(n, dtype))
            out = bb.emit_output(relax.Tuple([y, n]) if extra_use else y)
        bb.emit_func_output(out)
    return bb.get()


def _run(mod: tvm.IRModule) -> tvm.IRModule:
    with tvm.transform.PassContext(config={"testing.immutable_module": True}):
        return HalfNormOneKernel()(mod)


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_three_ops_become_one_kernel(norm, dtype):
    before = _half_norm(norm, dtype, extra_use=False)
    after = _run(before)
    calls = [b.value for blk in after["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call)]
    assert len(calls) == 1 and calls[0].op.name == "relax.call_tir", after["main"]
    assert calls[0].args[1][0].same_as(after["main"].params[0])  # reads x itself, in half precision
    assert calls[0].args[0].name_hint == ("rms_norm" if norm == "rms" else "layer_norm")
    assert_same_numerics(before, after, rtol=1e-6)


def test_norm_used_elsewhere_is_left_alone():
    before = _half_norm("rms", "float16", extra_use=True)
    tvm.ir.assert_structural_equal(_run(before), before)
