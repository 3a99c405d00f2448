"""TransposedTwins: a (K, N) constant finds the module's (N, K) constant equal to its transpose
(the decode GEMV's copy, which the prefill's wgmma GEMMs then read: one copy of each weight)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import tirx as T

from tvmfuse.rules.weight_twins import TransposedTwins


@T.prim_func(private=True, s_tir=True)
def _copy(a: T.Buffer((T.int64(4), T.int64(6)), "float16"), b: T.Buffer((T.int64(4), T.int64(6)), "float16")):
    for i, j in T.grid(T.int64(4), T.int64(6)):
        with T.sblock("copy"):
            vi, vj = T.axis.remap("SS", [i, j])
            b[vi, vj] = a[vi, vj]


def _module(consts: list[np.ndarray]) -> tuple[tvm.IRModule, list[relax.Constant]]:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4, 6], "float16"))
    made = [relax.const(c) for c in consts]
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.add_func(_copy, "copy")
            # only the arguments matter here: every constant is passed to a call_tir
            outs = [bb.emit(relax.call_tir(gv, relax.Tuple([x, c]), relax.TensorType([4, 6], "float16")))
                    for c in made]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get(), made


def test_finds_the_transpose_and_nothing_else():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 4)).astype("float16")  # (K, N)
    other = rng.standard_normal((4, 6)).astype("float16")
    mod, (c_w, c_t, c_other) = _module([w, np.ascontiguousarray(w.T), other])
    twins = TransposedTwins(mod)
    assert twins.of(c_w) is not None and twins.of(c_w).same_as(c_t)
    assert twins.of(c_other) is None  # (4, 6), but no (6, 4) constant equals its transpose


def test_no_twin_for_equal_shapes_with_different_values():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 4)).astype("float16")
    near = np.ascontiguousarray(w.T).copy()
    near[3, 5] += 1  # one element differs
    mod, (c_w, _) = _module([w, near])
    assert TransposedTwins(mod).of(c_w) is None
