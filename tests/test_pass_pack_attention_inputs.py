"""PackAttentionInputs: computed attention operands are written by one kernel into one buffer."""

from __future__ import annotations

import numpy as np
import tvm
from relax_util import assert_same_numerics, run_llvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvmfuse.passes import InjectiveGather, PackAttentionInputs


@I.ir_module
class Before:
    @R.function
    def main(q0: R.Tensor((1, 8, 2, 16), "float32"), kt: R.Tensor((1, 2, 8, 16), "float32"),
             v: R.Tensor((1, 8, 2, 16), "float32")) -> R.Tensor((1, 8, 2, 16), "float32"):
        with R.dataflow():
            q = R.multiply(q0, R.const(0.5, "float32"))
            k = R.permute_dims(kt, axes=[0, 2, 1, 3])
            o = R.nn.attention(q, k, v, causal_mask="TopLeft")
            R.output(o)
        return o


@I.ir_module
class Expected:
    @R.function
    def main(q0: R.Tensor((1, 8, 2, 16), "float32"), kt: R.Tensor((1, 2, 8, 16), "float32"),
             v: R.Tensor((1, 8, 2, 16), "float32")) -> R.Tensor((1, 8, 2, 16), "float32"):
        with R.dataflow():
            q = R.multiply(q0, R.const(0.5, "float32"))
            k = R.permute_dims(kt, axes=[0, 2, 1, 3])
            q_flat = R.reshape(q, R.shape([256]))
            k_flat = R.reshape(k, R.shape([256]))
            packed = R.concat((q_flat, k_flat), axis=0)
            q_view = R.memory.view(packed, R.shape([1, 8, 2, 16]), R.dtype("float32"),
                                   R.prim_value(T.int64(0)))
            k_at = R.memory.view(packed, R.shape([1, 8, 2, 16]), R.dtype("float32"),
                                 R.prim_value(T.int64(1024)))
            k_view = R.memory.ensure_zero_offset(k_at)
            o = R.nn.attention(q_view, k_view, v, causal_mask="TopLeft")
            R.output(o)
        return o


@I.ir_module
class OneComputed:
    """Only Q is computed (K and V are parameters): its kernel stays, nothing to pack."""

    @R.function
    def main(q0: R.Tensor((1, 8, 2, 16), "float32"), k: R.Tensor((1, 8, 2, 16), "float32"),
             v: R.Tensor((1, 8, 2, 16), "float32")) -> R.Tensor((1, 8, 2, 16), "float32"):
        with R.dataflow():
            q = R.multiply(q0, R.const(0.5, "float32"))
            o = R.nn.attention(q, k, v)
            R.output(o)
        return o


@I.ir_module
class GemmOperands:
    """Q and K are GEMM outputs (an epilogue and a view of one): the GEMMs write them already."""

    @R.function
    def main(x: R.Tensor((8, 32), "float32"), wq: R.Tensor((32, 32), "float32"),
             wk: R.Tensor((32, 32), "float32"), v: R.Tensor((1, 8, 2, 16), "float32"),
             ) -> R.Tensor((1, 8, 2, 16), "float32"):
        with R.dataflow():
            mq = R.matmul(x, wq)
            sq = R.multiply(mq, R.const(0.5, "float32"))
            q = R.reshape(sq, R.shape([1, 8, 2, 16]))
            mk = R.matmul(x, wk)
            k = R.reshape(mk, R.shape([1, 8, 2, 16]))
            o = R.nn.attention(q, k, v)
            R.output(o)
        return o


@I.ir_module
class SharedMask:
    """QKV slices of one GEMM output and a padding-mask bias shared by two attention calls."""

    @R.function
    def main(qkv: R.Tensor((2, 8, 3, 2, 16), "float32"), mask: R.Tensor((2, 8), "int64"),
             ) -> R.Tensor((2, 8, 2, 16), "float32"):
        with R.dataflow():
            q = R.reshape(R.strided_slice(qkv, axes=[2], begin=[0], end=[1]), R.shape([2, 8, 2, 16]))
            k = R.reshape(R.strided_slice(qkv, axes=[2], begin=[1], end=[2]), R.shape([2, 8, 2, 16]))
            v = R.reshape(R.strided_slice(qkv, axes=[2], begin=[2], end=[3]), R.shape([2, 8, 2, 16]))
            keep = R.reshape(R.astype(mask, "bool"), R.shape([2, 1, 1, 8]))
            bias = R.where(keep, R.const(0.0, "float32"), R.const(-1e9, "float32"))
            o1 = R.nn.attention_bias(q, k, v, bias)
            o2 = R.nn.attention_bias(o1, k, v, bias)
            R.output(o2)
        return o2


def _kernels(mod: tvm.IRModule) -> int:
    """Kernel launches after TVM's legalisation and fusion (the pass's purpose: fewer)."""
    from tvmfuse.passes.legalize_fixes import legalize_overrides

    mod = relax.transform.LegalizeOps(legalize_overrides())(mod)
    mod = InjectiveGather()(relax.transform.AnnotateTIROpPattern()(mod))
    mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(mod))
    return sum(isinstance(b.value, relax.Call) and b.value.op.same_as(tvm.ir.Op.get("relax.call_tir"))
               for block in mod["main"].body.blocks for b in block.bindings)


def test_two_computed_operands_packed():
    tvm.ir.assert_structural_equal(PackAttentionInputs()(Before), Expected)
    assert _kernels(Before) == 3 and _kernels(Expected) == 2  # q, k, attention → pack, attention


def test_packed_numerics():
    assert_same_numerics(Before, PackAttentionInputs()(Before))


def test_nothing_to_pack():
    tvm.ir.assert_structural_equal(PackAttentionInputs()(OneComputed), OneComputed)
    tvm.ir.assert_structural_equal(PackAttentionInputs()(GemmOperands), GemmOperands)


def test_slices_and_shared_mask_one_kernel():
    after = PackAttentionInputs()(SharedMask)
    # q/k/v slices and the mask: four kernels → one; the second call reads the mask's view.
    assert _kernels(SharedMask) == 4 + 2 and _kernels(after) == 1 + 2
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((2, 8, 3, 2, 16)).astype("float32")
    mask = np.ones((2, 8), "int64")
    mask[1, 5:] = 0
    np.testing.assert_allclose(run_llvm(after, qkv, mask), run_llvm(SharedMask, qkv, mask),
                               rtol=1e-6, atol=1e-6)


@I.ir_module
class Misaligned:
    """Q is 60 bytes: K's view would start off the 64-byte alignment (a copy): not packed."""

    @R.function
    def main(q0: R.Tensor((1, 3, 1, 5), "float32"), kt: R.Tensor((1, 1, 3, 5), "float32"),
             v: R.Tensor((1, 3, 1, 5), "float32")) -> R.Tensor((1, 3, 1, 5), "float32"):
        with R.dataflow():
            q = R.multiply(q0, R.const(0.5, "float32"))
            k = R.permute_dims(kt, axes=[0, 2, 1, 3])
            o = R.nn.attention(q, k, v)
            R.output(o)
        return o


def test_misaligned_offsets_not_packed():
    tvm.ir.assert_structural_equal(PackAttentionInputs()(Misaligned), Misaligned)
