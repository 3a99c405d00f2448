"""Small-M GEMMs (M ≤ 64, decode) on sm_80+ become weight-streaming kernels (:mod:`..kernels.gemm.gemv`).

``y[m, n] = f(Σ_k x[m, k] · W[n, k], params)`` for a fused GEMM PrimFunc that
:func:`..kernels.gemm.epilogue.analyze` reads (bias, residual, SiLU·gate pair of ``PairGemm``,
casts; M ≤ 64, fp16 / bf16, K a multiple of 8). Two entry points:

* :class:`Gemv`, a dlight-style rule (``apply(func, target, tunable) → Schedule | None``): the
  generated kernel for a function whose weight is already (N, K) (``B[j, k]``); None for anything
  else (M > 64, not a GEMM with a weight operand, a (K, N) weight, another target). Registered in
  :func:`.gpu_rules` before the large-GEMM rules.
* :data:`SmallMGemm`, a module pass (pipeline stage ``gemv``, before ``gemm_sm90_row_stats``:
  it takes the small-M GEMMs before the wgmma passes and the statistics merge look at them). It
  also handles what the rule cannot from inside one PrimFunc:

  - a (K, N) weight that is a constant (FoldConstant folded the Linear's transpose into it) is
    passed transposed, ``W (N, K)`` (the kernel streams rows of W along K);
  - a norm's statistics call (``NormGemmPrologue``'s ``mean, rstd``) whose every result is read
    only by small-M GEMMs over the same x is removed: those kernels compute the statistics from
    the x vectors their main loop reads anyway (:mod:`.gemm_sm90_stats` does the same on wgmma).

Kernels get ``tirx.is_scheduled``, ``tvmfuse.rule = "gemv"`` and the config in
``tvmfuse.gemm_tile``. A small-M GEMM the generator refuses keeps its body for the later rules and
gets ``tvmfuse.fallback = "gemv: <reason>"``. CUDA targets of sm_80 and newer only; elsewhere the
pass returns the module unchanged.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

from ..attrs import (
    CACHE_ATTENTION_ATTR,
    FALLBACK_ATTR,
    IN_LOOP_ATTR,
    REPLACES_ATTR,
    RULE_ATTR,
    TILE_ATTR,
)
from ..device_props import device_properties
from ..kernels.gemm.epilogue import FusedGemm, NotHandled, analyze
from ..kernels.gemm.gemv import MAX_M, GemvConfig, GemvProblem, check, gemv_kernel, pick_config
from ..kernels.gemm.opmath import opmath
from ..options import current_options
from ..passes import weight_arrays
from ..passes._util import const_array, mutate_functions
from .gemm_sm80 import _sm
from .gemm_sm90 import InLoopStats, _looks_like_gemm, kernel_signature
from .gemm_sm90_stats import stats_calls
from .gemv_append import NAME as APPEND_NAME
from .gemv_append import AppendSite, append_sites, gather_for
from .programmatic_launch import active as pdl_active
from .programmatic_launch import launches_programmatically

NAME = "gemv"
_CALL_TIR = "relax.call_tir"


def takes_target(target: Target | None) -> bool:
    """CUDA, sm_80 or newer (mma.sync, 16-byte loads), with ``Options.small_m_gemv`` on."""
    return (current_options().small_m_gemv and target is not None and target.kind.name == "cuda"
            and _sm(target) >= 80)


def small_m_gemm(func: tirx.PrimFunc) -> FusedGemm | None:
    """The fused GEMM of ``func`` when it is one with M ≤ 64, else None."""
    if not isinstance(func, tirx.PrimFunc) or (func.attrs and func.attrs.get("tirx.is_scheduled")):
        return None
    if not _looks_like_gemm(func):
        return None
    try:
        g = analyze(func)
    except NotHandled:
        return None
    return g if g.m <= max_m() else None


_WHOLE_ROWS = 1 << 30  # l2_prefetch bytes: the kernel clamps it to the block's rows


def l2_prefetch_bytes(target: Target | None, after_attention: bool = False) -> int:
    """Bytes of W each block prefetches before the programmatic-launch wait (0 where kernels do
    not launch programmatically: options off, or a target below sm_90). ``after_attention``: the
    GEMV reads a decode attention's output (the O projection), which moves few bytes for its
    time: with ``Options.gemv_prefetch_after_attention`` each block prefetches all its rows."""
    if not pdl_active(target):
        return 0
    if after_attention and current_options().gemv_prefetch_after_attention:
        return _WHOLE_ROWS
    return current_options().gemv_l2_prefetch_bytes


def preload_weights(target: Target | None, function: str) -> bool:
    """Whether a GEMV called by the Relax function ``function`` loads its first W vectors before
    the programmatic-launch wait (``Options.gemv_preload_weights``, where that function's kernels
    launch programmatically: the decode step under the default scope)."""
    return (pdl_active(target) and current_options().gemv_preload_weights
            and launches_programmatically(function))


def max_m() -> int:
    """Rows up to which GEMMs take this kernel: ``Options.gemv_max_m``, at most the kernel's 64."""
    return min(MAX_M, current_options().gemv_max_m)


def build_kernel(func: tirx.PrimFunc, cfg: GemvConfig | None = None, b_transposed: bool = False,
                 in_loop: InLoopStats | None = None, after_attention: bool = False,
                 preload: bool = False, append: tuple[tirx.PrimFunc, AppendSite] | None = None
                 ) -> tirx.PrimFunc:
    """The GEMV kernel replacing ``func``; raises :class:`NotHandled` with the reason.

    ``b_transposed``: ``func`` reads W as (K, N), the kernel takes its transpose (N, K) (the
    caller passes the transposed weight). ``in_loop``: the kernel computes x's row statistics;
    its signature is ``func``'s without the statistics parameters. ``after_attention``: x is a
    decode attention's output (:func:`l2_prefetch_bytes`). ``append``: the decode append PrimFunc
    reading the output and where (:mod:`.gemv_append`): the kernel makes its stores instead of
    writing y; its signature is ``func``'s without y, then the append's without the GEMV's output.
    """
    g = analyze(func)
    if g.m > MAX_M:
        raise NotHandled(f"M={g.m} > {MAX_M}")
    if g.layout != "nt" and not b_transposed:
        raise NotHandled("W is read as (K, N) (the kernel streams W (N, K))")
    if b_transposed and g.layout != "nt" and g.layout != "nn":
        raise NotHandled(f"layout {g.layout}")
    problem = GemvProblem(g.m, g.n, g.k, g.in_dtype, g.out_dtype, g.acc_odd is not None)
    cfg = cfg or pick_config(problem, device_properties().sms, current_options().gemv_simt_max_m,
                             row_stats=in_loop is not None)
    reason = check(problem, cfg, in_loop.stats if in_loop is not None else None)
    if reason:
        raise NotHandled(reason)
    expr = opmath(g.expr, g.out_dtype)  # the chain in fp32 on the sum, one rounding
    buffers, positions, store_value, pair_value = kernel_signature(func, g, expr, b_transposed,
                                                                   in_loop)
    gather, l2_prefetch = None, l2_prefetch_bytes(Target.current(allow_none=True), after_attention)
    if append is not None:
        if problem.pair:
            raise NotHandled("a pair epilogue feeds the append")
        if cfg.rows == 1:  # RoPE pairs need two rows a block (few rows: N < 2 · SMs)
            cfg = dataclasses.replace(cfg, rows=2)
        gather = gather_for(append[0], append[1], g.m, g.n, cfg.rows, g.out_dtype)
        if isinstance(gather, str):
            raise NotHandled(gather)
        a, b, out = positions
        buffers = [*(p for i, p in enumerate(buffers) if i != out),
                   *(p for i, p in enumerate(append[0].params) if i != append[1].qkv)]
        positions = (a - (a > out), b - (b > out), None)
        l2_prefetch = 0
    kernel = gemv_kernel(problem, cfg, buffers, *positions, store_value, pair_value,
                         row_stats=in_loop.stats if in_loop is not None else None,
                         l2_prefetch=l2_prefetch, preload=preload, gather=gather)
    rule = NAME if gather is None else APPEND_NAME
    return kernel.with_attrs({"tirx.is_scheduled": True, RULE_ATTR: rule, TILE_ATTR: cfg.tag})


class Gemv(GPUScheduleRule):
    """The weight-streaming kernel for a small-M GEMM with an (N, K) weight (module docstring)."""

    def __init__(self, config: GemvConfig | None = None) -> None:
        self.config = config  # None: pick_config

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if not self.is_target_available(target) or not takes_target(target):
            return None
        g = small_m_gemm(func)
        if g is None or g.layout != "nt":
            return None
        try:
            kernel = build_kernel(func, self.config)
        except NotHandled:
            return None  # the large-GEMM rules take it
        return s_tir.Schedule(kernel)


class _Plan:
    """What the pass does to each call: its kernel (per PrimFunc and statistics positions) and
    its new arguments."""

    def __init__(self) -> None:
        self.kernels: dict = {}  # (gvar, b_transposed, in_loop) → PrimFunc | reason str
        self.calls: list = []  # (call, key, args)
        self.appends: list = []  # (append call, key, args, in-place index): gemv_append
        self.stats_names: dict = {}  # key → the statistics PrimFunc's name (for the report)
        self.transposed = weight_arrays.DerivedConstants()  # (N, K) copies, one per (K, N) weight

    def kernel(self, mod, gvar, b_transposed, in_loop, after_attention=False,
               preload=False, append: AppendSite | None = None) -> tirx.PrimFunc | str:
        key = _key(gvar, b_transposed, in_loop, after_attention, preload, append)
        if key not in self.kernels:
            try:
                self.kernels[key] = build_kernel(
                    mod[gvar], b_transposed=b_transposed, in_loop=in_loop,
                    after_attention=after_attention, preload=preload,
                    append=None if append is None else (mod[append.call.args[0]], append))
            except NotHandled as why:
                self.kernels[key] = str(why)
        return self.kernels[key]


def _key(gvar, b_transposed: bool, in_loop: InLoopStats | None, after_attention: bool = False,
         preload: bool = False, append: AppendSite | None = None) -> tuple:
    """A dict key for one kernel variant (InLoopStats is not hashable)."""
    stats = None if in_loop is None else (in_loop.stats, in_loop.mean, in_loop.rstd)
    site = None if append is None else (append.call.args[0], append.qkv, append.state)
    return gvar, b_transposed, stats, after_attention, preload, site


def _attention_outputs(mod: tvm.IRModule, func: relax.Function) -> set:
    """Vars holding a decode attention's output (compile_lm's cache attention, the PrimFunc with
    ``CACHE_ATTENTION_ATTR``; folded with the append, the output of its (state, output) pair), or
    a reshape of one."""
    found: set = set()
    for b in (b for block in func.body.blocks for b in block.bindings):
        v = b.value
        if isinstance(v, relax.TupleGetItem) and v.tuple_value in found and v.index == 1:
            found.add(b.var)
        if not (isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op)):
            continue
        if (v.op.name in (_CALL_TIR, "relax.call_tir_inplace") and isinstance(v.args[0], tvm.ir.GlobalVar)
                and CACHE_ATTENTION_ATTR in (mod[v.args[0]].attrs or {})):
            found.add(b.var)
        elif v.op.name == "relax.reshape" and v.args[0] in found:
            found.add(b.var)
    return found


def _weight_arg(g: FusedGemm, args: list, plan: _Plan) -> tuple[bool, relax.Expr] | None:
    """(b_transposed, the weight argument the kernel takes) for one call; None: not streamable."""
    if g.layout == "nt":
        return False, args[g.b]
    w = const_array(args[g.b])  # a view of the constant: the module holds it, so hash() names it
    if w is None:
        return None
    return True, plan.transposed.get(hash(args[g.b]), lambda: weight_arrays.transpose(w))


def _plan_calls(mod: tvm.IRModule, func: relax.Function, plan: _Plan, refused: dict,
                caller: str) -> None:
    call_tir = tvm.ir.Op.get(_CALL_TIR)
    target = Target.current(allow_none=True)
    gemms = {}  # gvar → FusedGemm
    for gv, f in mod.functions_items():
        if isinstance(f, tirx.PrimFunc) and (g := small_m_gemm(f)) is not None:
            gemms[gv] = g
    if not gemms:
        return
    stats_for: list = []  # (GEMM call, InLoopStats, statistics PrimFunc name)
    for stats_call, _fn, spec, x, outputs, uses in stats_calls(mod, func):
        if outputs is None:
            continue
        consumers = list({id(u): u for o in outputs for u in uses.get(o, [])}.values())
        mine = []
        for user in consumers:
            if not (isinstance(user, relax.Call) and user.op == call_tir
                    and user.args[0] in gemms):
                break
            g, args = gemms[user.args[0]], list(user.args[1].fields)
            pos = [[i for i, a in enumerate(args) if a.same_as(o)] for o in outputs]
            weight = _weight_arg(g, args, plan)
            if not args[g.a].same_as(x) or any(len(p) != 1 for p in pos) or weight is None:
                break
            in_loop = InLoopStats(spec, pos[0][0] if spec.centered else None, pos[-1][0])
            if isinstance(plan.kernel(mod, user.args[0], weight[0], in_loop), str):
                break
            mine.append((user, in_loop, stats_call.args[0].name_hint))
        else:
            stats_for += mine
    attention_out = _attention_outputs(mod, func)
    sites = append_sites(mod, func) if current_options().decode_gemv_append else {}
    for binding in (b for block in func.body.blocks for b in block.bindings):
        call = binding.value
        if not (isinstance(call, relax.Call) and call.op == call_tir and call.args[0] in gemms):
            continue
        gv, g = call.args[0], gemms[call.args[0]]
        args = list(call.args[1].fields)
        weight = _weight_arg(g, args, plan)
        if weight is None:
            refused[gv] = "W is a (K, N) tensor computed at run time (the kernel streams W (N, K))"
            continue
        in_loop, stats_name = next(((il, n) for c, il, n in stats_for if c.same_as(call)),
                                   (None, None))
        after_attention = args[g.a] in attention_out
        # the preload reads W before the PDL wait: only a constant (a weight no kernel writes)
        preload = isinstance(weight[1], tvm.ir.expr.Constant) and preload_weights(target, caller)
        kernel = plan.kernel(mod, gv, weight[0], in_loop, after_attention, preload)
        if isinstance(kernel, str):
            refused[gv] = kernel
            continue
        args[g.b] = weight[1]
        if in_loop is not None:
            args = [a for i, a in enumerate(args) if i not in in_loop.dropped]
        site = sites.get(binding.var)
        if site is not None and not isinstance(
                plan.kernel(mod, gv, weight[0], in_loop, after_attention, preload, site), str):
            # the append's stores made by this kernel: the append call is replaced, this one dies
            key = _key(gv, weight[0], in_loop, after_attention, preload, site)
            a_args = list(site.call.args[1].fields)
            plan.appends.append((site.call, key, [*args, *(a for i, a in enumerate(a_args)
                                                           if i != site.qkv)],
                                 len(args) + site.state - (site.state > site.qkv)))
            plan.stats_names[key] = stats_name
            continue
        key = _key(gv, weight[0], in_loop, after_attention, preload)
        plan.calls.append((call, key, args))
        plan.stats_names[key] = stats_name


@mutator
class _Rewrite(PyExprMutator):
    """The planned calls → their kernels (added once per key)."""

    def __init__(self, mod: tvm.IRModule, plan: _Plan) -> None:
        super().__init__(mod)
        self.plan = plan
        self.added: dict = {}

    def kernel(self, key) -> tvm.ir.GlobalVar:
        if key not in self.added:
            plan = self.plan
            gv, in_loop, site = key[0], key[2], key[5]
            kernel = plan.kernels[key].with_attr(REPLACES_ATTR, gv.name_hint)
            if in_loop is not None:  # the report counts the statistics in this kernel
                kernel = kernel.with_attr(IN_LOOP_ATTR, [gv.name_hint, plan.stats_names[key]])
            suffix = "gemv" if site is None else APPEND_NAME
            self.added[key] = self.builder_.add_func(kernel, f"{gv.name_hint}_{suffix}")
        return self.added[key]

    def visit_call_(self, call):
        appended = next(((k, a, i) for c, k, a, i in self.plan.appends if c.same_as(call)), None)
        if appended is not None:
            key, args, inplace = appended
            return relax.op.call_tir_inplace(self.kernel(key), relax.Tuple(args), [inplace],
                                             call.ty_args[0])
        found = next(((k, a) for c, k, a in self.plan.calls if c.same_as(call)), None)
        if found is None:
            return super().visit_call_(call)
        key, args = found
        return relax.Call(tvm.ir.Op.get(_CALL_TIR), [self.kernel(key), relax.Tuple(args)],
                          call.attrs, call.ty_args)


@tvm.transform.module_pass(opt_level=0, name="SmallMGemm")
def SmallMGemm(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - pass names are CamelCase
    """Small-M GEMM calls → weight-streaming kernels (module docstring); on a copy of ``mod``."""
    if not takes_target(tvm.target.Target.current(allow_none=True)):
        return mod
    plan, refused = _Plan(), {}
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            _plan_calls(mod, func, plan, refused, gv.name_hint)
    mod = mod.clone()  # assigned into below: not the caller's module
    for gv, why in refused.items():
        mod[gv] = mod[gv].with_attr(FALLBACK_ATTR, f"{NAME}: {why}")
    if not plan.calls and not plan.appends:
        return mod
    return mutate_functions(_Rewrite(mod, plan))
