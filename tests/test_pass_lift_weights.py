"""LiftWeights: constants of ≥ 1 KiB become trailing parameters (``num_input``, ``params``), shared
across public functions and de-duplicated; small constants stay; nothing moves under the
``min_total_bytes`` threshold; the lifted module computes what the constants did."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tests.relax_util import apply_pass
from tvmfuse.passes.lift_weights import LiftWeights, take_weights

RNG = np.random.default_rng(0)
W = RNG.standard_normal((64, 32)).astype("float32")  # 8 KiB: lifted
B = RNG.standard_normal(32).astype("float32")  # 128 B: stays a constant
U = RNG.standard_normal((32, 32)).astype("float16")  # 2 KiB: lifted (only `decode` reads it)
X = relax.TensorType([4, 64], "float32")


def _main(bb: relax.BlockBuilder, w1: relax.Expr, w2: relax.Expr, extra: list[relax.Var]) -> None:
    """y = (x·w1 + B) + x·w2; the Before module passes W and an equal copy of it as w1 and w2."""
    x = relax.Var("x", X)
    with bb.function("main", [x, *extra]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, w1)), relax.const(B)))
            out = bb.emit_output(relax.op.add(y, bb.emit(relax.op.matmul(x, w2))))
        bb.emit_func_output(out)


def _decode(bb: relax.BlockBuilder, w: relax.Expr, u: relax.Expr, extra: list[relax.Var]) -> None:
    """z = (x·w)·u in float16 after a cast: a second entry point sharing W."""
    x = relax.Var("x", X)
    with bb.function("decode", [x, *extra]):
        with bb.dataflow():
            h = bb.emit(relax.op.astype(bb.emit(relax.op.matmul(x, w)), "float16"))
            out = bb.emit_output(relax.op.matmul(h, u))
        bb.emit_func_output(out)


def before(with_decode: bool = False) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    w = relax.const(W)
    _main(bb, w, relax.const(W.copy()), [])  # two nodes, equal bytes: one parameter
    if with_decode:
        _decode(bb, w, relax.const(U), [])
    return bb.get()


def expected(with_decode: bool = False) -> tvm.IRModule:
    bb = relax.BlockBuilder()

    def params() -> list[relax.Var]:
        ps = [relax.Var("w0.matmul", relax.TensorType([64, 32], "float32"))]
        return ps + [relax.Var("w1.matmul", relax.TensorType([32, 32], "float16"))] if with_decode else ps

    p = params()
    _main(bb, p[0], p[0], p)
    if with_decode:
        q = params()
        _decode(bb, q[0], q[1], q)
    mod = bb.get()
    for gv, func in list(mod.functions.items()):
        mod[gv] = func.with_attr("num_input", 1)
    return mod


def test_large_constants_become_shared_parameters():
    after = apply_pass(LiftWeights(), before())
    assert int(after["main"].attrs["num_input"]) == 1
    stripped, weights = take_weights(after)
    tvm.ir.assert_structural_equal(stripped, expected())
    assert [name for name, _ in weights] == ["w0.matmul"]
    np.testing.assert_array_equal(weights[0][1].numpy(), W)


def test_every_entry_point_takes_the_same_weights():
    after = apply_pass(LiftWeights(), before(with_decode=True))
    stripped, weights = take_weights(after)
    tvm.ir.assert_structural_equal(stripped, expected(with_decode=True))
    assert [name for name, _ in weights] == ["w0.matmul", "w1.matmul"]
    np.testing.assert_array_equal(weights[1][1].numpy(), U)


def test_under_the_total_threshold_nothing_moves():
    mod = before()
    tvm.ir.assert_structural_equal(apply_pass(LiftWeights(min_total_bytes=W.nbytes + 1), mod), mod)
    assert take_weights(mod)[1] == []
    lifted = apply_pass(LiftWeights(min_total_bytes=W.nbytes), mod)
    assert len(lifted["main"].params) == 2


def test_lifted_module_computes_the_same():
    x = RNG.standard_normal((4, 64)).astype("float32")
    mods = {"before": before(with_decode=True)}
    mods["after"], weights = take_weights(apply_pass(LiftWeights(), mods["before"]))
    outs = {}
    for key, mod in mods.items():
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        args = [tvm.runtime.tensor(x)] + ([t for _, t in weights] if key == "after" else [])
        outs[key] = [vm[f](*args).numpy() for f in ("main", "decode")]
    for got, ref in zip(outs["after"], outs["before"]):
        np.testing.assert_array_equal(got, ref)
    np.testing.assert_allclose(outs["after"][0], 2 * x @ W + B, rtol=1e-4, atol=1e-4)
