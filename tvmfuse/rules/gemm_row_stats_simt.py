"""CUDA fp32 GEMMs: a norm's row statistics computed by the GEMM kernel that consumes them.

NormGemmPrologue (``passes/norm_gemm.py``) turns ``norm(x) · W`` into a statistics kernel

    mean, rstd = layer_norm_stats(x)      (rms_norm_stats: rstd only), each (M, 1) fp32

and a GEMM whose epilogue applies them, ``rstd ⊙ (x·W' − mean ⊗ colsum) + c``. On sm_90a the
16-bit GEMMs are wgmma kernels that compute the statistics in their main loop
(:mod:`.gemm_sm90_stats`). fp32 GEMMs take neither tensor-core kernel; dlight-style SIMT tiles
schedule them, and without this pass the statistics kernel stayed a launch of its own.

``SimtGemmRowStats`` merges, for each statistics call whose every result is read only by fp32
GEMMs over the same ``x``, the statistics PrimFunc into each such GEMM PrimFunc (FuseTIR on a
``Primitive`` group of the two calls): one PrimFunc whose first blocks reduce the rows of ``x``
into (M, 1) intermediates (the same two-pass ``Σ(x − mean)²`` as the statistics kernel, so the
same numerics), then the matmul and its epilogue. The statistics call is removed: one launch less.
:class:`.gemm_simt_stats.GemmSimtRowStats` schedules the result: a shared-memory, register-blocked
SIMT GEMM whose thread block first computes the statistics of its own ``BM`` rows (a recompute
per column tile of blocks: each block reads its rows of ``x`` once more, mostly from L2, as the
blocks of one row tile run side by side).

Marks: the merged PrimFunc gets ``tvmfuse.in_loop_stats = [GEMM PrimFunc, statistics PrimFunc]``
(``tvmfuse report`` counts the statistics' op in that kernel) and ``tvmfuse.simt_row_stats``
(what the schedule rule looks for). A statistics PrimFunc that stays gets
``tvmfuse.stats_kept = <reason>``; a reason :mod:`.gemm_sm90_stats` gave stays where the GEMM is
not fp32 (then the wgmma path's reason is the one that matters).

Runs in ``pipeline.lower`` right after Sm90GemmRowStats (which takes the 16-bit sm_90a GEMMs
first) on the fused PrimFuncs; CUDA targets only, elsewhere the module is returned unchanged, as it
is with ``Options(simt_in_loop_stats=False)`` (measurements: every statistics kernel kept).
16-bit GEMMs are left alone: on sm_80 they are mma.sync kernels (GemmSM80) that a SIMT kernel
would slow down far more than one statistics launch costs.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

from ..attrs import IN_LOOP_ATTR, KEPT_ATTR, SIMT_ATTR
from ..kernels.tir_util import strip_cast
from ..options import current_options
from .fallback import try_rule
from .gemm_simt_stats import GemmSimtRowStats
from .gemm_sm90_stats import TUPLE_USED, stats_calls, swap_gemm_calls

NAME = "gemm_row_stats_simt"
_CALL_TIR = "relax.call_tir"
_FP32 = "float32"
_NOT_FP32 = "a tensor-core kernel; only fp32 SIMT GEMMs take the statistics"


def _matmul_operands(func: tirx.PrimFunc) -> tuple[tirx.Buffer, tirx.Buffer] | None:
    """The two buffers of the single ``C += A[..] · B[..]`` reduction block, or None."""
    found: list = []

    def visit(block: s_tir.SBlock) -> s_tir.SBlock:
        if any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars):
            body = block.body
            ok = isinstance(body, tirx.BufferStore) and isinstance(body.value, tirx.Add) \
                and isinstance(body.value.b, tirx.Mul)
            a, b = (strip_cast(body.value.b.a), strip_cast(body.value.b.b)) if ok else (0, 0)
            ok = ok and isinstance(a, tvm.ir.TensorLoad) and isinstance(b, tvm.ir.TensorLoad)
            found.append((a.source, b.source) if ok else None)
        return block

    tvm_ffi.structural_map(func.body, [((s_tir.SBlock,), visit)])
    return found[0] if len(found) == 1 and found[0] is not None else None


def _why_not(mod: tvm.IRModule, user, x: relax.Expr, outputs: list) -> str | None:
    """Why the consumer ``user`` of the statistics cannot compute them itself (None: it can)."""
    call_tir = tvm.ir.Op.get(_CALL_TIR)
    if not (isinstance(user, relax.Call) and user.op == call_tir
            and isinstance(mod[user.args[0]], tirx.PrimFunc)):
        return "a statistic is used outside a GEMM kernel"
    func = mod[user.args[0]]
    name = user.args[0].name_hint
    if func.attrs and func.attrs.get("tirx.is_scheduled"):
        return f"consumer {name} is scheduled already (a tuned or generated kernel)"
    operands = _matmul_operands(func)
    if operands is None:
        return f"consumer {name} is not one GEMM + epilogue"
    args = list(user.args[1].fields)
    a_pos = [i for i, p in enumerate(func.params) if p.same_as(operands[0])]
    if len(a_pos) != 1 or not args[a_pos[0]].same_as(x):
        return "the GEMM's A operand is not the tensor the statistics are taken of"
    dtypes = {str(b.dtype) for b in operands}
    if dtypes != {_FP32}:
        return f"consumer {name} is a {'/'.join(sorted(dtypes))} GEMM ({_NOT_FP32})"
    for o in outputs:
        if sum(1 for a in args if a.same_as(o)) != 1:
            return "a statistic is passed to the GEMM more than once"
    return None


def merge(stats: tirx.PrimFunc, stats_call: relax.Call, gemm: tirx.PrimFunc, gemm_call: relax.Call,
          outputs: list[relax.Var]) -> tuple[tirx.PrimFunc, list[relax.Expr]]:
    """One PrimFunc computing ``gemm_call`` with the statistics of ``stats_call`` made inside.

    Returns it and its call arguments: the GEMM's arguments without the statistics ``outputs``.
    The two calls are put in a ``Primitive`` Relax function and merged by FuseTIR (the statistics'
    outputs become intermediate buffers of the merged PrimFunc).
    """
    call_tir = tvm.ir.Op.get(_CALL_TIR)
    args: list[relax.Expr] = []
    for a in gemm_call.args[1].fields:  # each tensor once (x may be both A and a residual)
        if not any(a.same_as(o) for o in outputs) and not any(a.same_as(b) for b in args):
            args.append(a)
    params = [relax.Var(f"p{i}", a.ty) for i, a in enumerate(args)]
    bb = relax.BlockBuilder()
    stats_gv = bb.add_func(stats, "stats")
    gemm_gv = bb.add_func(gemm, "gemm")
    x = stats_call.args[1].fields[0]
    with bb.function("merged", params, attrs={"Primitive": True}, private=True):
        with bb.dataflow():
            x_param = next(p for a, p in zip(args, params) if a.same_as(x))
            st = bb.emit(relax.Call(call_tir, [stats_gv, relax.Tuple([x_param])], stats_call.attrs,
                                    stats_call.ty_args))
            inner = [bb.emit(relax.TupleGetItem(st, i)) for i in range(len(outputs))] \
                if len(outputs) == 2 else [st]
            gemm_args = []
            for a in gemm_call.args[1].fields:
                hit = [v for o, v in zip(outputs, inner) if a.same_as(o)]
                gemm_args.append(hit[0] if hit else next(
                    p for b, p in zip(args, params) if b.same_as(a)))
            y = bb.emit_output(relax.Call(call_tir, [gemm_gv, relax.Tuple(gemm_args)],
                                          gemm_call.attrs, gemm_call.ty_args))
        bb.emit_func_output(y)
    return fuse_merged(bb, args), args


def fuse_merged(bb: relax.BlockBuilder, args: list[relax.Expr]) -> tirx.PrimFunc:
    """FuseTIR's one PrimFunc for the ``Primitive`` function "merged" in ``bb`` (called once by a
    ``main`` over ``args``' types)."""
    merged_gv = bb.get().get_global_var("merged")
    outer = [relax.Var(f"a{i}", a.ty) for i, a in enumerate(args)]
    with bb.function("main", outer):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(merged_gv, outer))
        bb.emit_func_output(out)
    fused = relax.transform.FuseTIR()(bb.get())
    prims = [f for f in fused.functions.values() if isinstance(f, tirx.PrimFunc)]
    if len(prims) != 1:
        raise ValueError(f"FuseTIR left {len(prims)} PrimFuncs, expected 1")
    return prims[0].without_attr("global_symbol")


def _plan(mod: tvm.IRModule, func: relax.Function, kept: dict, target) -> list[tuple]:
    """(GEMM call, merged PrimFunc, new args) for every statistics call all its GEMMs can absorb
    (each merged PrimFunc is scheduled once here: one the rule refuses keeps the statistics)."""
    plans = []
    for call, stats_fn, spec, x, outputs, uses in stats_calls(mod, func):
        if outputs is None:
            kept[call.args[0]] = (TUPLE_USED, True)
            continue
        consumers = list({id(u): u for o in outputs for u in uses.get(o, [])}.values())
        why = next((w for u in consumers if (w := _why_not(mod, u, x, outputs))), None)
        if why or not consumers:
            kept[call.args[0]] = (why or "no consumer", not why or _NOT_FP32 not in why)
            continue
        mine = []
        for user in consumers:
            gemm_gv = user.args[0]
            merged, args = merge(stats_fn, call, mod[gemm_gv], user, outputs)
            merged = merged.with_attrs({IN_LOOP_ATTR: [gemm_gv.name_hint, call.args[0].name_hint],
                                        SIMT_ATTR: "layer" if spec.centered else "rms"})
            space, raised = try_rule(GemmSimtRowStats(), merged, target, False)
            if space is None:
                why = f"the SIMT schedule does not take {gemm_gv.name_hint}"
                kept[call.args[0]] = (f"{why} ({raised})" if raised else why, True)
                break
            mine.append((user, merged, args))
        else:
            plans += mine
    return plans


@tvm.transform.module_pass(opt_level=0, name="SimtGemmRowStats")
def SimtGemmRowStats(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - pass names are CamelCase
    """Statistics kernels feeding fp32 GEMMs on CUDA → statistics computed in those GEMMs."""
    target = tvm.target.Target.current(allow_none=True)
    if not current_options().simt_in_loop_stats or target is None or target.kind.name != "cuda":
        return mod
    kept: dict = {}
    plans = [p for f in list(mod.functions.values()) if isinstance(f, relax.Function)
             for p in _plan(mod, f, kept, target)]
    mod = mod.clone()  # assigned into below: not the caller's module
    for gv, (why, fp32) in kept.items():  # fp32: this pass's reason is the one that matters
        if fp32 or not (mod[gv].attrs and mod[gv].attrs.get(KEPT_ATTR)):
            mod[gv] = mod[gv].with_attr(KEPT_ATTR, why)
    if not plans:
        return mod
    return swap_gemm_calls(mod, plans)  # the statistics calls go as dead code
