"""ConstantIndexTensor: ``index_tensor`` on index grids computed from constants → a view, a
broadcast or a ``take``.

transformers 5's padding mask ``mask[batch_idx, kv_idx]`` reaches Relax as ``index_tensor`` on
``arange`` → ``expand_dims`` chains, an opaque gather kernel of its own (the corpus's
``attn_padding_bitwise_and`` was 4 kernels, now 2). Structure (Before / Expected), the cases left
alone, and numerics against the unrewritten module on llvm.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.canonical_util import apply, run_outputs
from tvmfuse.passes.canonical import ConstantIndexTensor


@I.ir_module
class Before:
    @R.function
    def main(m: R.Tensor((2, 24), "bool"), x: R.Tensor((2, 24), "float32")):
        with R.dataflow():
            b = R.arange(R.prim_value(0), R.prim_value(2), R.prim_value(1), dtype="int64")
            b4 = R.reshape(b, (2, 1, 1, 1))
            s = R.arange(R.prim_value(0), R.prim_value(24), R.prim_value(1), dtype="int64")
            s4 = R.reshape(s, (1, 1, 1, 24))
            view = R.index_tensor(m, (b4, s4))  # (2, 1, 1, 24): every element once, in order
            h = R.broadcast_to(b4, R.shape([2, 1, 3, 1]))
            wide = R.index_tensor(m, (h, s4))  # (2, 1, 3, 24): the same grid repeated along axis 2
            rev = R.flip(s, axis=0)
            back = R.index_tensor(x, (b4, R.reshape(rev, (1, 1, 1, 24))))  # keys reversed: a take
            out = (view, wide, back)
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(m: R.Tensor((2, 24), "bool"), x: R.Tensor((2, 24), "float32")):
        with R.dataflow():
            view = R.reshape(m, (2, 1, 1, 24))
            v = R.reshape(m, (2, 1, 1, 24))
            wide = R.broadcast_to(v, R.shape([2, 1, 3, 24]))
            t = R.reshape(x, (48,))
            back = R.take(t, R.const(np.arange(48).reshape(2, 24)[:, ::-1].reshape(2, 1, 1, 24), "int64"),
                          axis=0)
            out = (view, wide, back)
            R.output(out)
        return out


@I.ir_module
class LeftAlone:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), i: R.Tensor((3,), "int64")):
        with R.dataflow():
            a = R.index_tensor(x, (i,))  # a model input
            j = R.arange(R.prim_value(2), R.prim_value(6), R.prim_value(1), dtype="int64")
            b = R.index_tensor(x, (j,))  # out of range for axis 0 (size 4)
            out = (a, b)
            R.output(out)
        return out


def test_index_grids_become_views_broadcasts_and_takes():
    tvm.ir.assert_structural_equal(apply(ConstantIndexTensor(), Before), Expected)


def test_runtime_and_out_of_range_indices_stay():
    tvm.ir.assert_structural_equal(apply(ConstantIndexTensor(), LeftAlone), LeftAlone)


def test_numerics_equal_the_gather():
    rng = np.random.default_rng(0)
    arrays = (rng.random((2, 24)) < 0.5, rng.standard_normal((2, 24)).astype("float32"))
    after = run_outputs(apply(ConstantIndexTensor(), Before), *arrays)
    for got, want in zip(after, run_outputs(Before, *arrays)):
        np.testing.assert_array_equal(got, want)
