"""InjectiveGather: an embedding lookup's gather is injective, so FuseOps fuses its neighbours."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvmfuse.passes.gather_pattern import InjectiveGather


def _take(pattern: int):
    @T.prim_func(private=True, s_tir=True)
    def take(A: T.Buffer((T.int64(8), T.int64(4)), "float32"), idx: T.Buffer((T.int64(3),), "int64"),
             out: T.Buffer((T.int64(3), T.int64(4)), "float32")):
        T.func_attr({"op_pattern": pattern, "tirx.noalias": True})
        for i, j in T.grid(T.int64(3), T.int64(4)):
            with T.sblock("T_take"):
                vi, vj = T.axis.remap("SS", [i, j])
                T.reads(A[idx[vi], vj], idx[vi])
                T.writes(out[vi, vj])
                out[vi, vj] = A[idx[vi], vj]

    return take


def _module(pattern: int) -> tvm.IRModule:
    return tvm.IRModule({"take": _take(pattern)})


def test_gather_becomes_injective():
    tvm.ir.assert_structural_equal(InjectiveGather()(_module(8)), _module(2))


@T.prim_func(private=True, s_tir=True)
def _row_sum(A: T.Buffer((T.int64(3), T.int64(4)), "float32"), out: T.Buffer((T.int64(3),), "float32")):
    T.func_attr({"op_pattern": 8})
    for i, k in T.grid(T.int64(3), T.int64(4)):
        with T.sblock("sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                out[vi] = T.float32(0)
            out[vi] = out[vi] + A[vi, vk]


def test_other_opaque_functions_kept():
    mod = tvm.IRModule({"row_sum": _row_sum})
    tvm.ir.assert_structural_equal(InjectiveGather()(mod), mod)


@I.ir_module
class Embedding:
    """ONNX Gather as imported: ids normalised (where(ids < 0, ids + V, ids)), gathered, + wpe."""

    @R.function
    def main(ids: R.Tensor((2, 5), "int64"), wte: R.Tensor((11, 8), "float32"),
             wpe: R.Tensor((5, 8), "float32")) -> R.Tensor((2, 5, 8), "float32"):
        with R.dataflow():
            neg = R.less(ids, R.const(0, "int64"))
            wrapped = R.add(ids, R.const(11, "int64"))
            idx = R.where(neg, wrapped, ids)
            x = R.take(wte, idx, axis=0, mode="fast")
            y = R.add(x, wpe)
            R.output(y)
        return y


def _fused(mod: tvm.IRModule, gather_pass: bool) -> tvm.IRModule:
    from tvmfuse.passes.legalize_fixes import legalize_overrides

    mod = relax.transform.LegalizeOps(legalize_overrides())(mod)
    mod = relax.transform.AnnotateTIROpPattern()(mod)
    if gather_pass:
        mod = InjectiveGather()(mod)
    return relax.transform.FuseTIR()(relax.transform.FuseOps()(mod))


def _kernels(mod: tvm.IRModule) -> int:
    return sum(isinstance(f, tvm.tirx.PrimFunc) for f in mod.functions.values())


def _run(mod: tvm.IRModule, *arrays: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def test_where_take_add_one_kernel_same_numerics():
    plain, fused = _fused(Embedding, False), _fused(Embedding, True)
    assert _kernels(plain) == 3  # where (less, add fused in), take, add
    assert _kernels(fused) == 1
    rng = np.random.default_rng(0)
    ids = rng.integers(-11, 11, size=(2, 5)).astype("int64")  # negative ids wrap, as ONNX Gather
    wte = rng.standard_normal((11, 8)).astype("float32")
    wpe = rng.standard_normal((5, 8)).astype("float32")
    out = _run(fused, ids, wte, wpe)
    np.testing.assert_allclose(out, _run(plain, ids, wte, wpe), rtol=0, atol=0)
    np.testing.assert_allclose(out, wte[np.where(ids < 0, ids + 11, ids)] + wpe, rtol=1e-6)
