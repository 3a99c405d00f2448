"""sm_90a: a norm's row statistics move into the wgmma GEMM that consumes them.

NormGemmPrologue (``passes/norm_gemm.py``) turns ``norm(x) · W`` into a statistics kernel

    mean, rstd = layer_norm_stats(x)      (rms_norm_stats: rstd only), each (M, 1) fp32

and a GEMM whose epilogue applies them, ``rstd ⊙ (x·W' − mean ⊗ colsum) + c``. On sm_90a the GEMM
is the TIRx wgmma kernel (:mod:`.hopper.kernel`), whose consumers can compute the same statistics
from the A tiles its main loop already holds in shared memory (``gemm_kernel(row_stats=...)``).
``Sm90GemmRowStats`` does that rewrite: for each statistics call whose every result is read only by
GEMMs over the same ``x`` that the wgmma kernel takes, each such GEMM becomes a kernel computing
the statistics itself (without the statistics parameters) and the statistics call is removed: one
launch and one read of ``x`` less. Several GEMMs on one statistics call each compute their own
(a few shared-memory reads per K tile), so the call goes away.

Only where it pays (:func:`_costlier`, from H200 measurements): the extra shared-memory reads
cost ~12 % of a compute-bound main loop, more than the statistics kernel for large-N projections,
so those keep the kernel. Where it does not apply the statistics kernel stays, and its PrimFunc gets
``tvmfuse.stats_kept = <reason>`` (``tvmfuse report`` prints it for the boundary).

Runs in ``pipeline.lower`` before :func:`.gemm_sm90.Sm90Gemm` (on the fused PrimFuncs, after
``reshape_to_view``) and after :mod:`.gemm_sm90_producer_stats`, which takes the RMSNorm statistics
of a wgmma GEMM's output at no main-loop cost; the kernels it makes are tagged scheduled, so
Sm90Gemm and dlight skip them.
Only with an sm_90a target; elsewhere the module is returned unchanged, as it is with
``Options(sm90_in_loop_stats=False)`` (measurements: every statistics kernel kept);
``Options(sm90_in_loop_stats_always=True)`` moves the statistics whatever the cost estimate says,
as does ``Options(sm90_stats_warps=True)``, with which two producer warps compute them (the
consumers' main loop does no extra work; ``GemmConfig.stats_warps``).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.tirx.buffer import BufferType

from ..attrs import IN_LOOP_ATTR, KEPT_ATTR
from ..device_props import device_properties
from ..kernels.gemm.epilogue import NotHandled, analyze
from ..kernels.gemm.sm90 import RowStats
from ..options import current_options
from ..passes._util import mutate_functions
from ..passes.norm_gemm import row_stats_params
from .gemm_sm90 import InLoopStats, build_kernel, is_sm90a
from .weight_twins import TransposedTwins

NAME = "gemm_sm90_row_stats"
# Measured on the H200 (.devq stats1, 2026-11-30, fp16): the in-loop statistics (an extra shared-
# memory read of each A stage) slow a compute-bound main loop by 9-12 % (LN+Linear 8192x4096->4096:
# GEMM 485.9 vs 444.8 us; MLP fc1 2048x4096->16384: 563.0 vs 503.1 us), at 618 TFLOP/s without them;
# the statistics kernel reads x at 3.78 TB/s and takes at least 1.14 us (tools/bench/results/
# archive-2026-11-30-to-12-02.tar.xz: 2026-11-30-row-stats.json). In-loop pays only where 12 % of
# the GEMM is less than the statistics kernel: small GEMMs and launch-bound shapes, not large-N
# projections. The rates are kept as fractions of the device's peaks (device_props; H200: 775
# TFLOP/s fp16, 4.21 TB/s copy) so that the estimate follows the target.
IN_LOOP_OVERHEAD = 0.12
GEMM_EFFICIENCY = 618 / 775  # the wgmma GEMM's rate / the device's fp16 peak
STATS_EFFICIENCY = 3.78 / 4.21  # the statistics kernel's read rate / the device's copy bandwidth
STATS_MIN_S = 1.14e-6
_CALL_TIR = "relax.call_tir"


def row_stats_of(func: tirx.PrimFunc) -> RowStats | None:
    """What ``func`` computes when it is exactly NormGemmPrologue's statistics function of its
    first parameter (mean and rstd, or rstd), else None."""
    params = list(func.params)
    if len(params) not in (2, 3) or not all(isinstance(p.ty, BufferType) for p in params) \
            or len(params[0].shape) != 2:
        return None  # (a scalar parameter: a symbol passed by value, as --dynamic's arange takes)
    if not all(isinstance(d, tirx.IntImm) for d in params[0].shape):
        return None  # symbolic rows: the wgmma GEMM's in-loop statistics need a static M
    found = row_stats_params(func)
    return None if found is None else RowStats(found[1], found[0])


@dataclass
class _Plan:
    """One statistics call and the GEMM calls that take over its work."""

    call: relax.Call
    outputs: list[relax.Var]  # [mean, rstd] or [rstd]
    gemms: list[relax.Call]
    kernels: list[tirx.PrimFunc]
    weights: list  # per GEMM: (B's position, the (N, K) constant it reads instead) or None


def _bindings(func: relax.Function) -> list:
    return [b for block in func.body.blocks for b in block.bindings]


def _uses(func: relax.Function) -> dict:
    """var → list of the binding values (or the function's result) that read it."""
    uses: dict = {}
    for b in _bindings(func):
        for v in relax.analysis.free_vars(b.value):
            uses.setdefault(v, []).append(b.value)
    for v in relax.analysis.free_vars(func.body.body):
        uses.setdefault(v, []).append(None)
    return uses


TUPLE_USED = "the statistics tuple is used other than by its two items"


def stats_calls(mod: tvm.IRModule, func: relax.Function):
    """The statistics ``call_tir``s of ``func``: ``(call, stats PrimFunc, RowStats, x, outputs,
    uses)``, ``outputs`` being the (mean, rstd) items (LayerNorm) or the rstd result (RMSNorm), or
    None when the LayerNorm tuple is used other than by its two items (:data:`TUPLE_USED`)."""
    call_tir = tvm.ir.Op.get(_CALL_TIR)
    uses = _uses(func)
    items: dict = {}  # stats var → {index: TupleGetItem var}
    for b in _bindings(func):
        if isinstance(b.value, relax.TupleGetItem) and isinstance(b.value.tuple_value, relax.Var):
            items.setdefault(b.value.tuple_value, {})[int(b.value.index)] = b.var
    for b in _bindings(func):
        call = b.value
        if not (isinstance(call, relax.Call) and call.op == call_tir):
            continue
        stats_fn = mod[call.args[0]]
        if not isinstance(stats_fn, tirx.PrimFunc) or (spec := row_stats_of(stats_fn)) is None:
            continue
        outputs = [b.var]
        if spec.centered:
            got = items.get(b.var, {})
            ok = set(got) == {0, 1} and len(uses.get(b.var, [])) == 2
            outputs = [got[0], got[1]] if ok else None
        yield call, stats_fn, spec, call.args[1].fields[0], outputs, uses


def _plan(mod: tvm.IRModule, func: relax.Function, kept: dict, twins: TransposedTwins) -> list[_Plan]:
    """Statistics calls of ``func`` that all their GEMM consumers can compute themselves."""
    plans = []
    for call, _fn, spec, x, outputs, uses in stats_calls(mod, func):
        if outputs is None:
            kept[call.args[0]] = TUPLE_USED
            continue
        plan, why = _Plan(call, outputs, [], [], []), None
        consumers = {id(u): u for o in outputs for u in uses.get(o, [])}.values()
        for user in consumers:
            why = _why_not(mod, user, x, outputs, spec, plan, call.args[0].name_hint, twins)
            if why:
                break
        if why:
            kept[call.args[0]] = why
        elif plan.gemms:
            plans.append(plan)
    return plans


def _why_not(mod: tvm.IRModule, user, x: relax.Expr, outputs: list, spec: RowStats,
             plan: _Plan, stats_name: str, twins: TransposedTwins) -> str | None:
    """Why ``user`` cannot compute the statistics itself (None: it can; added to ``plan``)."""
    call_tir = tvm.ir.Op.get(_CALL_TIR)
    if not (isinstance(user, relax.Call) and user.op == call_tir
            and isinstance(mod[user.args[0]], tirx.PrimFunc)):
        return "a statistic is used outside a GEMM kernel"
    func = mod[user.args[0]]
    args = list(user.args[1].fields)
    try:
        g = analyze(func)
    except NotHandled as err:
        return f"consumer {user.args[0].name_hint} is not a GEMM + epilogue ({err})"
    if not args[g.a].same_as(x):
        return "the GEMM's A operand is not the tensor the statistics are taken of"
    pos = []
    for o in outputs:
        found = [i for i, a in enumerate(args) if a.same_as(o)]
        if len(found) != 1:
            return "a statistic is passed to the GEMM more than once"
        pos.append(found[0])
    opts = current_options()
    if not (opts.sm90_in_loop_stats_always or opts.sm90_stats_warps) and (why := _costlier(g)):
        return why
    in_loop = InLoopStats(spec, pos[0] if spec.centered else None, pos[-1])
    twin = twins.of(args[g.b]) if g.layout == "nn" else None  # the decode GEMV's (N, K) copy
    try:
        kernel = build_kernel(func, in_loop=in_loop, b_transposed=twin is not None)
    except NotHandled as err:
        return f"the sm_90a wgmma GEMM does not take {user.args[0].name_hint}: {err}"
    plan.weights.append((g.b, twin) if twin is not None else None)
    plan.gemms.append(user)
    plan.kernels.append(kernel.with_attr(IN_LOOP_ATTR, [user.args[0].name_hint, stats_name]))
    return None


def _costlier(g) -> str | None:
    """Why computing the statistics in this GEMM is estimated slower than the statistics kernel.

    in-loop ≈ IN_LOOP_OVERHEAD · 2·M'·N·K / (GEMM_EFFICIENCY · peak FLOP/s) (M' = M rounded up
    to the 128-row tile); kernel ≈ max(M·K·bytes / (STATS_EFFICIENCY · bandwidth), STATS_MIN_S),
    with the peaks of the current target's device (:func:`tvmfuse.device_props.device_properties`).
    """
    device = device_properties()
    m_pad = -(-g.m // 128) * 128
    in_loop = IN_LOOP_OVERHEAD * 2.0 * m_pad * g.n * g.k / (GEMM_EFFICIENCY * device.fp16_flops)
    kernel = max(g.m * g.k * 2 / (STATS_EFFICIENCY * device.bandwidth), STATS_MIN_S)
    if in_loop <= kernel:
        return None
    return (f"computing them in the {g.m}x{g.n}x{g.k} GEMM's main loop is estimated at "
            f"{in_loop * 1e6:.1f} us, the statistics kernel at {kernel * 1e6:.1f} us")


@tvm.transform.module_pass(opt_level=0, name="Sm90GemmRowStats")
def Sm90GemmRowStats(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - pass names are CamelCase
    """Statistics kernels feeding sm_90a wgmma GEMMs → statistics computed in those GEMMs."""
    if not current_options().sm90_in_loop_stats or not is_sm90a(tvm.target.Target.current(allow_none=True)):
        return mod
    kept: dict = {}
    twins = TransposedTwins(mod)
    plans = [p for gv, f in mod.functions_items() if isinstance(f, relax.Function)
             for p in _plan(mod, f, kept, twins)]
    mod = mod.clone()  # assigned into below: not the caller's module
    for gv, why in kept.items():
        mod[gv] = mod[gv].with_attr(KEPT_ATTR, why)
    if not plans:
        return mod
    swaps = []
    for plan in plans:
        for gemm, kernel, weight in zip(plan.gemms, plan.kernels, plan.weights):
            args = list(gemm.args[1].fields)
            if weight is not None:
                args[weight[0]] = weight[1]
            args = [a for a in args if not any(a.same_as(o) for o in plan.outputs)]
            swaps.append((gemm, kernel, args))
    return swap_gemm_calls(mod, swaps)


def swap_gemm_calls(mod: tvm.IRModule, swaps: list[tuple]) -> tvm.IRModule:
    """Each ``(call, kernel, args)``: the GEMM ``call_tir`` becomes ``call_tir(kernel, args)``
    (the kernel added as ``<old name>_stats``); the statistics calls this leaves unused, and
    their PrimFuncs, are removed as dead code."""
    return mutate_functions(_SwapGemms(mod, swaps))


@mutator
class _SwapGemms(PyExprMutator):
    """:func:`swap_gemm_calls`' mutator."""

    def __init__(self, mod: tvm.IRModule, swaps: list[tuple]) -> None:
        super().__init__(mod)
        self.swaps = swaps

    def visit_call_(self, call):
        match = next(((k, a) for g, k, a in self.swaps if g.same_as(call)), None)
        if match is None:
            return super().visit_call_(call)
        kernel, args = match
        gv = self.builder_.add_func(kernel, f"{call.args[0].name_hint}_stats")
        return relax.Call(tvm.ir.Op.get(_CALL_TIR), [gv, relax.Tuple(args)], call.attrs,
                          call.ty_args)

