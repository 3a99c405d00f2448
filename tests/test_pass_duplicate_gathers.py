"""DuplicateGathers: a gather read by several elementwise kernels gets one copy per reader."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

from tests.relax_util import apply_pass, fresh
from tests.test_pass_gather_pattern import _row_sum as opaque_row_sum
from tests.test_pass_gather_pattern import _take as gather_take
from tvmfuse.passes.duplicate_gathers import DuplicateGathers

_take = gather_take(2)  # the injective gather InjectiveGather leaves


@T.prim_func(private=True, s_tir=True)
def _mul(a: T.Buffer((T.int64(3), T.int64(4)), "float32"), b: T.Buffer((T.int64(3), T.int64(4)), "float32"),
         out: T.Buffer((T.int64(3), T.int64(4)), "float32")):
    T.func_attr({"op_pattern": 0, "tirx.noalias": True})
    for i, j in T.grid(T.int64(3), T.int64(4)):
        with T.sblock("mul"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = a[vi, vj] * b[vi, vj]


@T.prim_func(private=True, s_tir=True)
def _reshape(a: T.Buffer((T.int64(3), T.int64(4)), "float32"),
             out: T.Buffer((T.int64(3), T.int64(1), T.int64(4)), "float32")):
    T.func_attr({"op_pattern": 2, "tirx.noalias": True})
    for i, o, j in T.grid(T.int64(3), T.int64(1), T.int64(4)):
        with T.sblock("reshape"):
            vi, vo, vj = T.axis.remap("SSS", [i, o, j])
            out[vi, vo, vj] = a[vi, vj]


@T.prim_func(private=True, s_tir=True)
def _mul3(a: T.Buffer((T.int64(3), T.int64(1), T.int64(4)), "float32"),
          b: T.Buffer((T.int64(3), T.int64(1), T.int64(4)), "float32"),
          out: T.Buffer((T.int64(3), T.int64(1), T.int64(4)), "float32")):
    T.func_attr({"op_pattern": 0, "tirx.noalias": True})
    for i, o, j in T.grid(T.int64(3), T.int64(1), T.int64(4)):
        with T.sblock("mul"):
            vi, vo, vj = T.axis.remap("SSS", [i, o, j])
            out[vi, vo, vj] = a[vi, vo, vj] * b[vi, vo, vj]


_row_sum = opaque_row_sum.with_attr("op_pattern", 3)  # a reduction reading the gather

T34 = relax.TensorType([3, 4], "float32")


def _module(readers: str, duplicated: bool = False, reshaped: bool = False) -> tvm.IRModule:
    """``cos = take(table, pos)`` (``reshaped``: then reshaped to (3, 1, 4), as RoPE tables are)
    read by ``readers`` ("mul,mul": two rotations, "mul,sum": a rotation and a reduction, "mul":
    one); ``duplicated``: the copies the pass should make."""
    bb = relax.BlockBuilder()
    take, mul, mul3, row_sum, reshape = (bb.add_func(f, n) for f, n in (
        (_take, "take"), (_mul, "mul"), (_mul3, "mul3"), (_row_sum, "row_sum"), (_reshape, "reshape")))
    t134 = relax.TensorType([3, 1, 4], "float32")
    table = relax.Var("table", relax.TensorType([8, 4], "float32"))
    pos = relax.Var("pos", relax.TensorType([3], "int64"))
    q, k = (relax.Var(n, t134 if reshaped else T34) for n in "qk")

    def gather(name):
        out = bb.emit(relax.call_tir(take, [table, pos], T34), name)
        return bb.emit(relax.call_tir(reshape, [out], t134), f"{name}_r") if reshaped else out

    with bb.function("main", [table, pos, q, k]):
        with bb.dataflow():
            cos = None if duplicated else gather("cos")
            outs = []
            for i, kind in enumerate(readers.split(",")):
                src = cos if cos is not None else gather("cos_dup")
                if kind == "mul":
                    outs.append(bb.emit(relax.call_tir(mul3 if reshaped else mul, [(q, k)[i], src],
                                                       t134 if reshaped else T34)))
                else:
                    outs.append(bb.emit(relax.call_tir(row_sum, [src], relax.TensorType([3], "float32"))))
            out = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else outs[0])
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("reshaped", [False, True], ids=["gather", "gather_reshape"])
def test_each_elementwise_reader_gets_its_copy(reshaped):
    """The gather (with the reshape after it, the chain is copied whole) once per rotation."""
    tvm.ir.assert_structural_equal(apply_pass(DuplicateGathers(), _module("mul,mul", reshaped=reshaped)),
                                   _module("mul,mul", duplicated=True, reshaped=reshaped))


def test_fuse_ops_then_fuses_each_copy_into_its_reader():
    """The point of the copies: after FuseOps no function is the gather alone."""
    before = _module("mul,mul")
    fused = relax.transform.FuseOps()(apply_pass(DuplicateGathers(), before))
    called = [gv.name_hint for gv, f in fused.functions.items() if isinstance(f, relax.Function)
              and gv.name_hint != "main"]
    assert called and all("take" in name for name in called), called
    unfused = relax.transform.FuseOps()(fresh(before))
    assert [gv.name_hint for gv in unfused.functions if gv.name_hint == "take"]  # kept alone before


def test_same_numbers_on_llvm():
    rng = np.random.default_rng(0)
    before = _module("mul,mul")
    args = [rng.standard_normal((8, 4)).astype("float32"), np.array([5, 0, 7], "int64"),
            rng.standard_normal((3, 4)).astype("float32"), rng.standard_normal((3, 4)).astype("float32")]
    cos = args[0][args[1]]
    for mod in (fresh(before), apply_pass(DuplicateGathers(), before)):
        exe = tvm.compile(relax.transform.LegalizeOps()(mod), target="llvm")
        got = relax.VirtualMachine(exe, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
        np.testing.assert_allclose(got[0].numpy(), args[2] * cos, rtol=1e-6)
        np.testing.assert_allclose(got[1].numpy(), args[3] * cos, rtol=1e-6)


def test_left_alone_when_a_reader_does_not_fuse_or_there_is_one_reader():
    for mod in (_module("mul,sum"), _module("mul")):
        tvm.ir.assert_structural_equal(apply_pass(DuplicateGathers(), mod), mod)


def test_a_large_gather_keeps_its_one_kernel(monkeypatch):
    """Above MAX_BYTES (a prefill's tables) re-gathering in every reader costs more than the
    launch it saves: left alone."""
    from tvmfuse.passes import duplicate_gathers

    monkeypatch.setattr(duplicate_gathers, "MAX_BYTES", 3 * 4 * 4 - 1)  # the (3, 4) fp32 output
    tvm.ir.assert_structural_equal(apply_pass(DuplicateGathers(), _module("mul,mul")), _module("mul,mul"))


def _branching() -> tvm.IRModule:
    """``cos = take(table, pos)`` read by a rotation and by a reshape whose result a reduction
    reads (Falcon's ONNX export: the gathered K is rotated and also sliced for a concatenate)."""
    bb = relax.BlockBuilder()
    take, mul, row_sum, reshape = (bb.add_func(f, n) for f, n in (
        (_take, "take"), (_mul, "mul"), (_row_sum3, "row_sum3"), (_reshape, "reshape")))
    table = relax.Var("table", relax.TensorType([8, 4], "float32"))
    pos = relax.Var("pos", relax.TensorType([3], "int64"))
    q = relax.Var("q", T34)
    with bb.function("main", [table, pos, q]):
        with bb.dataflow():
            cos = bb.emit(relax.call_tir(take, [table, pos], T34), "cos")
            rot = bb.emit(relax.call_tir(mul, [q, cos], T34))
            cos_r = bb.emit(relax.call_tir(reshape, [cos], relax.TensorType([3, 1, 4], "float32")))
            red = bb.emit(relax.call_tir(row_sum, [cos_r], relax.TensorType([3, 1], "float32")))
            out = bb.emit_output(relax.Tuple([rot, red]))
        bb.emit_func_output(out)
    return bb.get()


@T.prim_func(private=True, s_tir=True)
def _row_sum3(a: T.Buffer((T.int64(3), T.int64(1), T.int64(4)), "float32"),
              out: T.Buffer((T.int64(3), T.int64(1)), "float32")):
    T.func_attr({"op_pattern": 3, "tirx.noalias": True})
    for i, o, j in T.grid(T.int64(3), T.int64(1), T.int64(4)):
        with T.sblock("sum"):
            vi, vo, vj = T.axis.remap("SSR", [i, o, j])
            with T.init():
                out[vi, vo] = T.float32(0)
            out[vi, vo] = out[vi, vo] + a[vi, vo, vj]


def test_a_member_read_by_another_chain_stays():
    """The gather's other reader is the next link of a chain that is not copied (its end feeds
    a reduction): the gather keeps its binding. The pass dropped it as "copied away" while the
    reshape still read it — a module with an unbound var (Falcon's ONNX exports then failed in
    codegen: "Var lv33 is not defined")."""
    before = _branching()
    after = apply_pass(DuplicateGathers(), before)
    tvm.ir.assert_structural_equal(after, before)
