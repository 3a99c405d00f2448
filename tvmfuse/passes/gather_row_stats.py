"""Row statistics of gathered table rows are gathered from the statistics of the table.

A decoder's first norm reads the embedding lookup directly (Llama: ``x = E[ids]``, then
``rms_norm(x)``), so after NormGemmPrologue its row statistics are a kernel over ``x``::

    x    = take(E, idx, axis=0)            (B, S, H)     E: constant (V, H)
    rstd = rms_norm_stats(x)               (B, S, 1)

A row-wise function of gathered rows is the gather of the function of every row, so with
``R = rms_norm_stats(E)`` (V × 1, computed at compile time by running the very same stats
PrimFunc on E's rows on the host) ``rstd = take(R, idx, axis=0)``. Both gathers read the same
indices; one kernel writes them into one buffer, read back through views::

    packed = concat([reshape(take(E, idx), [-1]), reshape(take(R, idx), [-1])])
    x      = view(packed, (B, S, H))
    rstd   = ensure_zero_offset(view(packed, (B, S, 1), offset |x| bytes))

The statistics kernel disappears; the gather kernel also writes B·S floats more. Applies to
single-output statistics PrimFuncs (RMSNorm's ``rstd``) of a gather of a constant 2-D table on
axis 0, or of reshapes of it that keep the rows (torch's embedding gathers on flat ids), when
``|x|`` is a multiple of 64 bytes (the views are then copy-free). Sits after NormGemmPrologue,
which makes the statistics calls, and after MixedPrecision: a table it made half is left alone (the
packed buffer has one dtype; the GEMM that reads the half rows computes their statistics).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._util import const_array, is_op, shape_expr, static_shape
from .norm_gemm import row_stats_params

_ALIGN = 64  # bytes: allocation alignment; ensure_zero_offset is copy-free at such offsets


def _table_stats(func: tirx.PrimFunc, table: np.ndarray) -> np.ndarray:
    """Run the row-wise PrimFunc ``func`` ((..., K) → (..., 1)) over every row of ``table``."""
    x_buf, out_buf = func.params[0], func.params[-1]
    x_shape = [int(d) for d in x_buf.shape]  # 0.27: params are buffer vars
    out_shape = [int(d) for d in out_buf.shape]
    rows, k = int(np.prod(x_shape[:-1])), x_shape[-1]
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    dtype = str(out_buf.dtype)
    result = np.empty((table.shape[0], 1), dtype)
    chunk = np.zeros((rows, k), table.dtype)
    out = tvm.runtime.tensor(np.zeros(out_shape, dtype))
    for start in range(0, table.shape[0], rows):
        n = min(rows, table.shape[0] - start)
        chunk[:n] = table[start:start + n]
        chunk[n:] = 1  # padding rows: any finite values
        lib["main"](tvm.runtime.tensor(chunk.reshape(x_shape)), out)
        result[start:start + n, 0] = out.numpy().reshape(-1)[:n]
    return result


def _matches(mod: tvm.IRModule, value: relax.Expr, bound: dict):
    """(stats PrimFunc, gathered var, take call) when ``value`` is call_tir(stats, (x,)) with
    x = take(E, idx, axis=0) or reshapes of it that keep the rows."""
    if not is_op(value, "relax.call_tir") or not isinstance(value.args[0], tvm.ir.GlobalVar):
        return None
    found = row_stats_params(mod[value.args[0]])
    if len(value.args[1].fields) != 1 or found is None or found[1]:
        return None  # NormGemmPrologue's single-output statistics (RMSNorm's rstd) only
    x = value.args[1].fields[0]
    gathered = x
    for _ in range(4):  # torch's embedding: take on flat ids, then reshapes to (B, S, H)
        if not is_op(bound.get(gathered), "relax.reshape"):
            break
        gathered = bound[gathered].args[0]
    take = bound.get(gathered)
    if not is_op(take, "relax.take") or take.attrs.axis is None or int(take.attrs.axis) != 0:
        return None
    table = const_array(take.args[0])
    x_shape, out_shape, idx_shape = static_shape(x), static_shape(value), static_shape(take.args[1])
    if table is None or table.ndim != 2 or x_shape is None or idx_shape is None \
            or out_shape != x_shape[:-1] + [1] or x_shape[-1] != table.shape[1] \
            or int(np.prod(x_shape[:-1])) != int(np.prod(idx_shape)):
        return None
    if int(np.prod(x_shape)) * table.dtype.itemsize % _ALIGN:
        return None
    return mod[value.args[0]], gathered, take


@mutator
class _Rewrite(PyExprMutator):
    """At the gather's binding: emit both gathers, the packing and the views; drop the stats call."""

    def __init__(self, mod: tvm.IRModule, plans: dict) -> None:
        super().__init__(mod)
        self.plans = plans  # gathered var → (stats var, take call, R table)
        self.dropped = {plan[0] for plan in plans.values()}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.dropped:
            return
        plan = self.plans.get(binding.var)
        if plan is None:
            super().visit_var_binding_(binding)
            return
        stats_var, take, table = plan
        x_shape, out_shape = static_shape(binding.var), static_shape(stats_var)
        x = self.builder_.emit(self.visit_expr(take))
        rows = self.builder_.emit(relax.op.take(relax.const(table), self.visit_expr(take.args[1]),
                                                axis=0, mode=take.attrs.mode))
        parts = [self.builder_.emit(relax.op.reshape(v, shape_expr([int(np.prod(s))])))
                 for v, s in ((x, x_shape), (rows, out_shape))]
        packed = self.builder_.emit(relax.op.concat(parts, axis=0))
        dtype = str(binding.var.ty.dtype)
        x_view = self.builder_.emit(relax.op.memory.view(
            packed, shape_expr(x_shape), dtype, relax.prim_value(tirx.IntImm("int64", 0))))
        offset = int(np.prod(x_shape)) * tvm.DataType(dtype).bits // 8
        stats = self.builder_.emit(relax.op.memory.ensure_zero_offset(self.builder_.emit(
            relax.op.memory.view(packed, shape_expr(out_shape), dtype,
                                 relax.prim_value(tirx.IntImm("int64", offset))))))
        self.set_var_remap(binding.var, x_view)
        self.set_var_remap(stats_var, stats)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.GatherRowStats")
class GatherRowStats:
    """stats(take(E, idx)) → take(stats(E), idx), packed with the gather (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # the rewriter's builder adds to its module in place: not the caller's
        changed = False
        for gvar, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
            plans, seen = {}, set()
            for var, value in bound.items():
                found = _matches(mod, value, bound)
                if found is None:
                    continue
                stats_func, x, take = found  # x: the gathered var (its reshapes stay views of it)
                table = const_array(take.args[0])
                if x in seen or str(stats_func.params[-1].dtype) != str(table.dtype):
                    continue  # one packing per gather; the packed buffer has one dtype
                seen.add(x)
                plans[x] = (var, take, _table_stats(stats_func, table))
            if not plans:
                continue
            rewriter = _Rewrite(mod, plans)
            new = rewriter.visit_expr(func)
            mod = rewriter.builder_.get()
            mod[gvar] = relax.analysis.remove_all_unused(new)
            changed = True
        if changed:  # the statistics PrimFuncs no call reads any more
            entries = [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, relax.Function)]
            mod = relax.transform.DeadCodeElimination(entries)(mod)
        return mod
