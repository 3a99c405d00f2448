"""RemoveRedundantReshapes: TVM's no-op reshapes and broadcasts of a tensor to its own shape go."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tests.relax_util import apply_pass
from tvmfuse.passes import RemoveRedundantReshapes


@I.ir_module
class SameShapeBroadcast:
    """A broadcast of (B, 1, K) to its own shape (a Linear's 3-D matmul at batch > 1, after the
    attention rewrite): a copy kernel, dropped; the real broadcast (1, K) → (B, K) stays."""

    @R.function
    def main(x: R.Tensor((8, 1, 256), "float16"), w: R.Tensor((256, 64), "float16"),
             b: R.Tensor((1, 64), "float16")) -> R.Tensor((8, 64), "float16"):
        with R.dataflow():
            y = R.broadcast_to(x, R.shape([8, 1, 256]))
            z = R.reshape(y, R.shape([8, 256]))
            c = R.broadcast_to(b, R.shape([8, 64]))
            o = R.add(R.matmul(z, w), c)
            R.output(o)
        return o


@I.ir_module
class SameShapeBroadcastExpected:
    @R.function
    def main(x: R.Tensor((8, 1, 256), "float16"), w: R.Tensor((256, 64), "float16"),
             b: R.Tensor((1, 64), "float16")) -> R.Tensor((8, 64), "float16"):
        with R.dataflow():
            z = R.reshape(x, R.shape([8, 256]))
            c = R.broadcast_to(b, R.shape([8, 64]))
            o = R.add(R.matmul(z, w), c)
            R.output(o)
        return o


@I.ir_module
class SymbolicBroadcast:
    """The same with a symbolic batch: (B, 1, 256) → (B, 1, 256) goes, (B, 1, 256) → (B, 4, 256) stays."""

    @R.function
    def main(x: R.Tensor(("B", 1, 256), "float16")) -> R.Tensor(("B", 4, 256), "float16"):
        B = T.int64()
        with R.dataflow():
            y = R.broadcast_to(x, R.shape([B, 1, 256]))
            z = R.broadcast_to(y, R.shape([B, 4, 256]))
            R.output(z)
        return z


@I.ir_module
class SymbolicBroadcastExpected:
    @R.function
    def main(x: R.Tensor(("B", 1, 256), "float16")) -> R.Tensor(("B", 4, 256), "float16"):
        B = T.int64()
        with R.dataflow():
            z = R.broadcast_to(x, R.shape([B, 4, 256]))
            R.output(z)
        return z


def test_same_shape_broadcast_removed():
    tvm.ir.assert_structural_equal(apply_pass(RemoveRedundantReshapes(), SameShapeBroadcast),
                                   SameShapeBroadcastExpected)
    tvm.ir.assert_structural_equal(apply_pass(RemoveRedundantReshapes(), SymbolicBroadcast),
                                   SymbolicBroadcastExpected)
