"""GatherRowStats: the first norm's row statistics of an embedding lookup become a second gather."""

from __future__ import annotations

import numpy as np
import tvm
from relax_util import run_llvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvmfuse.passes import GatherRowStats, InjectiveGather, NormGemmPrologue
from tvmfuse.passes._util import const_array, shape_expr


@I.ir_module
class Model:
    """Llama's start: x = E[ids]; rms_norm(x)·W; x is also the residual."""

    @R.function
    def main(ids: R.Tensor((1, 4), "int64"), table: R.Tensor((10, 16), "float32"),
             g: R.Tensor((16,), "float32"), w: R.Tensor((16, 16), "float32"),
             ) -> R.Tensor((1, 4, 16), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            x = R.take(table, ids, axis=0, mode="fast")
            y = R.nn.rms_norm(x, g, axes=[-1], epsilon=1e-6)
            z = R.matmul(y, w)
            out = R.add(x, z)
            R.output(out)
        return out


def _params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"table": rng.standard_normal((10, 16)).astype("float32"),
            "g": rng.standard_normal(16).astype("float32"),
            "w": rng.standard_normal((16, 16)).astype("float32")}


def _before(params: dict[str, np.ndarray]) -> tvm.IRModule:
    """After NormGemmPrologue: x·(diag(g)W) scaled by rms_norm_stats(x)."""
    return NormGemmPrologue()(relax.transform.BindParams("main", params)(Model))


def _expected(params: dict[str, np.ndarray], w_fold: np.ndarray, stats: np.ndarray) -> tvm.IRModule:
    ids = relax.Var("ids", relax.TensorType((1, 4), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [ids], attrs={"num_input": 1}):
        with bb.dataflow():
            x = bb.emit(relax.op.take(relax.const(params["table"]), ids, axis=0, mode="fast"))
            rows = bb.emit(relax.op.take(relax.const(stats), ids, axis=0, mode="fast"))
            packed = bb.emit(relax.op.concat([bb.emit(relax.op.reshape(x, shape_expr([64]))),
                                              bb.emit(relax.op.reshape(rows, shape_expr([4])))], axis=0))
            x_view = bb.emit(relax.op.memory.view(packed, shape_expr([1, 4, 16]), "float32",
                                                  relax.prim_value(tvm.tirx.IntImm("int64", 0))))
            rstd = bb.emit(relax.op.memory.ensure_zero_offset(bb.emit(relax.op.memory.view(
                packed, shape_expr([1, 4, 1]), "float32", relax.prim_value(tvm.tirx.IntImm("int64", 256))))))
            acc = bb.emit(relax.op.matmul(x_view, relax.const(w_fold), out_dtype="float32"))
            z = bb.emit(relax.op.multiply(acc, rstd))
            out = bb.emit_output(relax.op.add(x_view, z))
        bb.emit_func_output(out)
    return bb.get()


def _constants(mod: tvm.IRModule) -> list[np.ndarray]:
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(const_array(e)))
    return [a for a in found if a is not None and a.ndim == 2]


def test_stats_become_a_packed_gather():
    params = _params()
    after = GatherRowStats()(_before(params))
    table, stats, w_fold = _constants(after)
    # The table's statistics, computed by running the stats PrimFunc on the host: rsqrt(mean(E²)+ε).
    ref = 1 / np.sqrt((params["table"].astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(stats, ref, rtol=1e-6)
    np.testing.assert_array_equal(table, params["table"])
    tvm.ir.assert_structural_equal(after, _expected(params, w_fold, stats))


def test_numerics_and_one_kernel():
    params = _params()
    before = _before(params)
    after = GatherRowStats()(before)
    ids = np.array([[3, 0, 9, 3]], "int64")
    np.testing.assert_allclose(run_llvm(after, ids), run_llvm(before, ids), rtol=1e-5, atol=1e-5)
    fused = relax.transform.LegalizeOps()(after)
    fused = InjectiveGather()(relax.transform.AnnotateTIROpPattern()(fused))
    fused = relax.transform.FuseTIR()(relax.transform.FuseOps()(fused))
    names = [b.value.args[0].name_hint for block in fused["main"].body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and b.value.op.same_as(tvm.ir.Op.get("relax.call_tir"))]
    assert not any("stats" in n for n in names)  # no statistics kernel left
    assert len(names) == 2, names  # the packed gathers, the GEMM with residual epilogue


def test_not_a_gather_unchanged():
    params = _params()
    mod = relax.transform.BindParams("main", {k: v for k, v in params.items() if k != "table"})(Model)
    before = NormGemmPrologue()(mod)  # table is an input: no constant rows to precompute
    tvm.ir.assert_structural_equal(GatherRowStats()(before), before)
