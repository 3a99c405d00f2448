"""BoundedSlices: a clamped symbolic slice that the symbol's range proves in bounds → assume_inbound.

``table[:S]`` of a 64-row table, as torch.export writes RoPE's ``cos[:s]``: under ``1 <= S <= 64``
the slice's shape ``min(S, 64)`` is ``S`` and the add after it gets its exact shape back; under
``S <= 128`` (or with no bounds at all) nothing proves it and the slice is left alone. Numerics:
the rewritten module built for llvm against numpy at two lengths.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I  # noqa: E741
from tvm.script import relax as R
from tvm.script import tirx as T

from tests.relax_util import apply_pass
from tvmfuse.passes.canonical import BoundedSlices


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor(("S", 16), "float32"), table: R.Tensor((64, 16), "float32")):
        S = T.int64()
        R.func_attr({"tir_var_lower_bound": {"S": 1}, "tir_var_upper_bound": {"S": 64}})
        with R.dataflow():
            rows = R.strided_slice(table, axes=[0], begin=[0], end=[S])
            y = R.add(x, rows)
            R.output(y)
        return y


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor(("S", 16), "float32"),
             table: R.Tensor((64, 16), "float32")) -> R.Tensor(("S", 16), "float32"):
        S = T.int64()
        R.func_attr({"tir_var_lower_bound": {"S": 1}, "tir_var_upper_bound": {"S": 64}})
        with R.dataflow():
            rows = R.strided_slice(table, axes=[0], begin=[0], end=[S], assume_inbound=True)
            y = R.add(x, rows)
            R.output(y)
        return y


@I.ir_module
class PastTheTable:
    """``S`` up to 128 but the table has 64 rows: ``min(S, 64)`` is not ``S``."""

    @R.function
    def main(x: R.Tensor(("S", 16), "float32"), table: R.Tensor((64, 16), "float32")):
        S = T.int64()
        R.func_attr({"tir_var_lower_bound": {"S": 1}, "tir_var_upper_bound": {"S": 128}})
        with R.dataflow():
            rows = R.strided_slice(table, axes=[0], begin=[0], end=[S])
            y = R.add(x, rows)
            R.output(y)
        return y


@I.ir_module
class Unbounded:
    """No ``tir_var_upper_bound``: nothing is known about ``S``."""

    @R.function
    def main(x: R.Tensor(("S", 16), "float32"), table: R.Tensor((64, 16), "float32")):
        S = T.int64()
        with R.dataflow():
            rows = R.strided_slice(table, axes=[0], begin=[0], end=[S])
            y = R.add(x, rows)
            R.output(y)
        return y


def test_proved_slice_becomes_inbound():
    after = apply_pass(BoundedSlices(), Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert [int(d) if isinstance(d, tvm.tirx.IntImm) else str(d)
            for d in after["main"].ret_ty.shape.values] == ["S", 16]


@pytest.mark.parametrize("mod", [PastTheTable, Unbounded], ids=["past-the-table", "unbounded"])
def test_unproved_slice_left_alone(mod):
    tvm.ir.assert_structural_equal(apply_pass(BoundedSlices(), mod), mod)


def test_numerics_at_two_lengths():
    after = apply_pass(BoundedSlices(), Before)
    with tvm.target.Target("llvm"):
        lowered = relax.transform.LegalizeOps()(after)
    vm = relax.VirtualMachine(tvm.compile(lowered, target="llvm"), tvm.cpu())
    rng = np.random.default_rng(0)
    table = rng.standard_normal((64, 16)).astype("float32")
    for length in (5, 64):
        x = rng.standard_normal((length, 16)).astype("float32")
        out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(table)).numpy()
        np.testing.assert_allclose(out, x + table[:length], rtol=1e-6)
