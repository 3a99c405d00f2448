"""CastBeforeSlices (tvmfuse/passes/cast_before_slices.py): the casts of a tensor's slices become
one cast above the slices, so the GEMM that makes the tensor writes the narrow dtype."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.relax_util import apply_pass, random_inputs, run_llvm
from tvmfuse.passes.cast_before_slices import CastBeforeSlices


@I.ir_module
class QKV:
    @R.function
    def main(x: R.Tensor((4, 16), "float16"), w: R.Tensor((16, 24), "float16"),
             rstd: R.Tensor((4, 1), "float32")) -> R.Tensor((4, 8), "float16"):
        with R.dataflow():
            mm = R.matmul(x, w, out_dtype="float32")
            y = R.multiply(mm, rstd)
            q32 = R.strided_slice(y, axes=[1], begin=[0], end=[8])
            k32 = R.strided_slice(y, axes=[1], begin=[8], end=[16])
            v32 = R.strided_slice(y, axes=[1], begin=[16], end=[24])
            q = R.astype(q32, "float16")
            k = R.astype(k32, "float16")
            v = R.astype(v32, "float16")
            qk = R.add(q, k)
            out = R.add(qk, v)
            R.output(out)
        return out


@I.ir_module
class QKVExpected:
    @R.function
    def main(x: R.Tensor((4, 16), "float16"), w: R.Tensor((16, 24), "float16"),
             rstd: R.Tensor((4, 1), "float32")) -> R.Tensor((4, 8), "float16"):
        with R.dataflow():
            mm = R.matmul(x, w, out_dtype="float32")
            y = R.multiply(mm, rstd)
            y_cast = R.astype(y, "float16")
            q32 = R.strided_slice(y_cast, axes=[1], begin=[0], end=[8])
            k32 = R.strided_slice(y_cast, axes=[1], begin=[8], end=[16])
            v32 = R.strided_slice(y_cast, axes=[1], begin=[16], end=[24])
            qk = R.add(q32, k32)
            out = R.add(qk, v32)
            R.output(out)
        return out


def test_structure_and_bit_identical_values():
    after = apply_pass(CastBeforeSlices, QKV)
    tvm.ir.assert_structural_equal(after, QKVExpected)
    args = random_inputs(QKV)
    np.testing.assert_array_equal(run_llvm(after, *args), run_llvm(QKV, *args))


@I.ir_module
class PartlyRead:
    @R.function
    def main(x: R.Tensor((4, 16), "float16"),
             w: R.Tensor((16, 24), "float16")) -> R.Tensor((4, 8), "float16"):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            q32 = R.strided_slice(y, axes=[1], begin=[0], end=[8])
            q = R.astype(q32, "float16")
            R.output(q)
        return q


@I.ir_module
class SliceUsedInFp32:
    @R.function
    def main(x: R.Tensor((4, 16), "float16"),
             w: R.Tensor((16, 16), "float16")) -> R.Tensor((4, 8), "float32"):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            a32 = R.strided_slice(y, axes=[1], begin=[0], end=[8])
            b32 = R.strided_slice(y, axes=[1], begin=[8], end=[16])
            a = R.astype(a32, "float16")
            b = R.astype(a, "float32")
            out = R.add(b, b32)
            R.output(out)
        return out


@I.ir_module
class TwoDtypes:
    @R.function
    def main(x: R.Tensor((4, 16), "float16"),
             w: R.Tensor((16, 16), "float16")) -> R.Tensor((4, 8), "float16"):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            a32 = R.strided_slice(y, axes=[1], begin=[0], end=[8])
            b32 = R.strided_slice(y, axes=[1], begin=[8], end=[16])
            a = R.astype(a32, "float16")
            b = R.astype(b32, "bfloat16")
            c = R.astype(b, "float16")
            out = R.add(a, c)
            R.output(out)
        return out


@I.ir_module
class Parameter:
    @R.function
    def main(y: R.Tensor((4, 16), "float32")) -> R.Tensor((4, 8), "float16"):
        with R.dataflow():
            a32 = R.strided_slice(y, axes=[1], begin=[0], end=[8])
            b32 = R.strided_slice(y, axes=[1], begin=[8], end=[16])
            a = R.astype(a32, "float16")
            b = R.astype(b32, "float16")
            out = R.add(a, b)
            R.output(out)
        return out


@pytest.mark.parametrize("mod", [PartlyRead, SliceUsedInFp32, TwoDtypes, Parameter],
                         ids=["slices-cover-part", "a-slice-read-in-fp32", "two-dtypes", "parameter"])
def test_left_alone(mod):
    """Not every element read, a slice also used in fp32, two target dtypes, a parameter (not
    made here): unchanged, and the input module is not modified."""
    kept = mod.script()
    after = apply_pass(CastBeforeSlices, mod)
    tvm.ir.assert_structural_equal(after, mod)
    assert mod.script() == kept
