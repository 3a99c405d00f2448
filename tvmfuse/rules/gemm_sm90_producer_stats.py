"""sm_90a: a norm's row statistics come from the GEMM that wrote its input.

A pre-norm decoder's residual stream is written by a GEMM epilogue (``h = x + o_proj(attn)``,
``y = h + down(…)``) and read at once by the next norm's statistics kernel (NormGemmPrologue)::

    h    = call_tir(gemm, (a, W, r))                       (M, N) fp16: out = cast(a·W) + r
    rstd = call_tir(rms_norm_stats, (h,))                  (M, 1) fp32: rsqrt(Σ_k h[i, k]² / N + eps)
    y    = call_tir(gemm2, (h, W2, rstd))                  reads rstd[i] in its epilogue

The producer already holds every value of h in registers when it stores it, so it also writes
``P[t, i] = Σ_{k in column tile t} h[i, k]²`` (fp32, one row per 128×BN output tile column, from
the rounded values it stores: the same numbers the statistics kernel squares), and each consumer
forms ``rstd[i] = rsqrt(Σ_t P[t, i] / N + eps)`` in its epilogue::

    h, P = call_tir(gemm_partials, (a, W, r))              P: (⌈N / BN⌉, M) fp32
    y    = call_tir(gemm2_from_partials, (h, W2, P))

LayerNorm's (mean, rstd) likewise: each tile row's mean and sum of squared deviations M2 (the
8-value chunks of a lane and then the quad's lanes joined by Chan's rule: no E[x²] − mean²
cancellation), ``P`` (2·⌈N / BN⌉, M); the consumer joins the tiles the same way,
``rstd = rsqrt(M2 / N + eps)``. The LayerNorm form is behind
``Options.sm90_producer_stats_layernorm`` (off): its GPU numerics pass, but the GEMMs after a
LayerNorm already take its statistics in their main loop (:mod:`.gemm_sm90_stats`) and GPT-2's
prefill was no faster with the partials (session 32, H100).

One kernel and one read of h (M·N·2 bytes) fewer per norm, for ⌈N/BN⌉·M·4 bytes (LayerNorm: twice
that) written and read back. Applies to the statistics of a static-M, plain (not paired) 16-bit
GEMM output that the wgmma kernel takes, when every reader of them is a wgmma GEMM over h
(:func:`.gemm_sm90.build_kernel` with ``in_loop`` partials) and the producer reads no statistics
itself. Runs in ``pipeline.lower`` before Sm90GemmRowStats (whose in-loop statistics cost the
consumers' main loop ~12 %; it takes the statistics calls left here) and Sm90Gemm, which leaves
the kernels made here (tagged scheduled) alone. A producer whose weight Sm90Gemm would have read
transposed (a transpose kernel's output, or a constant it prefers (N, K)) is left alone, so that
its tile stays the one Sm90Gemm picks. ``Options.sm90_producer_stats`` switches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..attrs import IN_LOOP_ATTR, PARTIALS_ATTR, REPLACES_ATTR, RULE_ATTR
from ..kernels.gemm.epilogue import NotHandled, analyze
from ..kernels.gemm.sm90 import RowStats
from ..options import current_options
from ..passes import weight_arrays
from ..passes._util import const_array, mutate_functions
from .gemm_sm90 import InLoopStats, _is_transpose, build_kernel, is_sm90a, partials_of, select_config
from .gemm_sm90_stats import _bindings, row_stats_of, stats_calls
from .weight_twins import TransposedTwins

NAME = "gemm_sm90_producer_stats"
_CALL_TIR = "relax.call_tir"


@dataclass
class _Plan:
    """A statistics call, the GEMM call producing its input and the GEMM calls reading its
    statistics."""

    stats: relax.Call
    outputs: list[relax.Var]  # [rstd] or [mean, rstd]
    producer: relax.Call
    producer_kernel: tirx.PrimFunc
    producer_b: tuple | None  # (B's position, the (N, K) twin it reads instead) or None
    rows: int  # of the partials: column tiles (RMSNorm), twice that (LayerNorm)
    consumers: list[tuple[relax.Call, tirx.PrimFunc, InLoopStats, tuple | None]]  # call, kernel, B


class _Kernels:
    """:func:`.gemm_sm90.build_kernel` once per (PrimFunc, arguments) in a pass: a decoder's
    layers call the same fused PrimFuncs, so the plans of every layer and prefill entry ask for
    the same few kernels (the 7B-shaped LM, 32 layers: 115 s of a 279 s compile built them
    call by call, H100 machine, session 39). A :class:`NotHandled` is kept and raised again."""

    def __init__(self, mod: tvm.IRModule):
        self._mod = mod
        self._built: dict[tuple, tirx.PrimFunc | NotHandled] = {}

    def __call__(self, gv: tvm.ir.GlobalVar, **kwargs) -> tirx.PrimFunc:
        key = (gv.name_hint, tuple(sorted(kwargs.items())))
        if key not in self._built:
            try:
                self._built[key] = build_kernel(self._mod[gv], **kwargs)
            except NotHandled as err:
                self._built[key] = err
        got = self._built[key]
        if isinstance(got, NotHandled):
            raise got
        return got


def _prim(mod: tvm.IRModule, call) -> tirx.PrimFunc | None:
    """The PrimFunc a ``call_tir`` calls (None: not a call_tir of a PrimFunc)."""
    if not (isinstance(call, relax.Call) and call.op == tvm.ir.Op.get(_CALL_TIR)):
        return None
    func = mod[call.args[0]]
    return func if isinstance(func, tirx.PrimFunc) else None


def _weight(mod: tvm.IRModule, func: tirx.PrimFunc, args: list, twins: TransposedTwins,
            defs: dict) -> tuple[tuple | None, str | None]:
    """``(B swap or None, why not)`` for a GEMM this rule builds: a (K, N) constant with an (N, K)
    twin is read as the twin (as Sm90Gemm does); a B that Sm90Gemm would read transposed otherwise
    is a reason to leave the GEMM to it."""
    g = analyze(func)
    if g.layout != "nn":
        return None, None
    b = args[g.b]
    twin = twins.of(b)
    if twin is not None:
        return (g.b, twin), None
    producer = _prim(mod, defs.get(b)) if isinstance(b, relax.Var) else None
    if producer is not None and _is_transpose(producer):
        return None, "its B is a transpose kernel's output (Sm90Gemm reads the original)"
    if isinstance(b, tvm.ir.expr.Constant) and isinstance(g.m, int) and \
            select_config(g.m, g.n, layout="nt") != select_config(g.m, g.n, layout="nn"):
        # Sm90Gemm's choice for such a B read by one call: its transpose, made now
        w = const_array(b) if twins.uses.get(hash(b)) == 1 else None
        if w is None:
            return None, "Sm90Gemm would read its constant B transposed"
        return (g.b, weight_arrays.constant(weight_arrays.transpose(w))), None
    return None, None


def _is_statistic(mod: tvm.IRModule, arg, defs: dict) -> bool:
    """``arg`` is a statistics call's result (rstd, or an item of LayerNorm's (mean, rstd))."""
    value = defs.get(arg) if isinstance(arg, relax.Var) else None
    if isinstance(value, relax.TupleGetItem):
        value = defs.get(value.tuple_value)
    func = _prim(mod, value)
    return func is not None and row_stats_of(func) is not None


def _plan_one(mod: tvm.IRModule, call: relax.Call, spec: RowStats, x, outputs: list, uses: dict,
              defs: dict, twins: TransposedTwins, kernels: _Kernels) -> _Plan | str:
    """The plan for one statistics call, or why it keeps its kernel."""
    producer = defs.get(x) if isinstance(x, relax.Var) else None
    func = _prim(mod, producer)
    if func is None or (func.attrs is not None and func.attrs.get("tirx.is_scheduled")):
        return "its input is not written by an unscheduled fused GEMM kernel"
    if spec.centered and not current_options().sm90_producer_stats_layernorm:
        return "LayerNorm partials are off (Options.sm90_producer_stats_layernorm)"
    try:
        g = analyze(func)
    except NotHandled as err:
        return f"its input's producer is not a GEMM + epilogue ({err})"
    args = list(producer.args[1].fields)
    if any(_is_statistic(mod, a, defs) for a in args):
        return "its producer reads a norm's statistics (Sm90GemmRowStats may take them in-loop)"
    swap, why = _weight(mod, func, args, twins, defs)
    if why:
        return f"producer {producer.args[0].name_hint}: {why}"
    if g.out != len(args) or len(producer.ty_args) != 1 or not isinstance(x.ty, relax.TensorType):
        return "the producer has more than one output"
    try:
        kernel = kernels(producer.args[0], b_transposed=swap is not None, partials_out=True,
                         partials_centered=spec.centered).with_attrs({
            REPLACES_ATTR: producer.args[0].name_hint,  # the report's ops: the fused function's
            PARTIALS_ATTR: call.args[0].name_hint, RULE_ATTR: NAME})
        count, cols = partials_of(func, b_transposed=swap is not None)
    except NotHandled as err:
        return f"producer {producer.args[0].name_hint}: {err}"
    plan = _Plan(call, outputs, producer, kernel, swap, count * (2 if spec.centered else 1), [])
    partial_spec = RowStats(spec.centered, spec.eps, partials=count, partial_cols=cols)
    for user in {id(u): u for o in outputs for u in uses.get(o, [])}.values():
        ufunc = _prim(mod, user)
        if ufunc is None:
            return "a statistic is read outside a GEMM kernel"
        uargs = list(user.args[1].fields)
        try:
            ug = analyze(ufunc)
        except NotHandled as err:
            return f"consumer {user.args[0].name_hint} is not a GEMM + epilogue ({err})"
        pos = [[i for i, a in enumerate(uargs) if a.same_as(o)] for o in outputs]
        if not uargs[ug.a].same_as(x) or any(len(p) != 1 for p in pos):
            return (f"consumer {user.args[0].name_hint} does not read each statistic once with "
                    "A = the input")
        uswap, why = _weight(mod, ufunc, uargs, twins, defs)
        if why:
            return f"consumer {user.args[0].name_hint}: {why}"
        try:
            in_loop = InLoopStats(partial_spec, pos[0][0] if spec.centered else None, pos[-1][0])
            ukernel = kernels(user.args[0], b_transposed=uswap is not None, in_loop=in_loop)
        except NotHandled as err:
            return f"consumer {user.args[0].name_hint}: {err}"
        # the report lists the statistics among this kernel's ops, as for in-loop statistics
        merged = [user.args[0].name_hint, call.args[0].name_hint]
        plan.consumers.append((user, ukernel.with_attr(IN_LOOP_ATTR, merged), in_loop, uswap))
    return plan if plan.consumers else "the statistics have no reader"


@tvm.transform.module_pass(opt_level=0, name="Sm90ProducerRowStats")
def Sm90ProducerRowStats(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - CamelCase pass
    """Norm statistics kernels over a wgmma GEMM's output → partial sums in that GEMM."""
    if not current_options().sm90_producer_stats or \
            not is_sm90a(tvm.target.Target.current(allow_none=True)):
        return mod
    twins = TransposedTwins(mod)
    kernels = _Kernels(mod)
    plans = []
    for _gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        defs = {b.var: b.value for b in _bindings(func)}
        for call, _fn, spec, x, outputs, uses in stats_calls(mod, func):
            if outputs is None:
                continue
            got = _plan_one(mod, call, spec, x, outputs, uses, defs, twins, kernels)
            if not isinstance(got, str):  # a reason: the statistics kernel stays
                plans.append(got)
    if not plans:
        return mod
    return _rewrite(mod, plans)


def _rewrite(mod: tvm.IRModule, plans: list[_Plan]) -> tvm.IRModule:
    """Producers return ``(h, P)``; consumers read P where they read rstd; the statistics calls
    are left unused and removed with their PrimFuncs."""
    return mutate_functions(_Rewrite(mod, plans))


@mutator
class _Rewrite(PyExprMutator):
    """:func:`_rewrite`'s mutator."""

    def __init__(self, mod: tvm.IRModule, plans: list[_Plan]) -> None:
        super().__init__(mod)
        self.plans = plans
        self.partials: dict = {}  # id(plan) → the P var

    def _args(self, call, swap) -> list:
        args = [self.visit_expr(a) for a in call.args[1].fields]
        if swap is not None:
            args[swap[0]] = swap[1]
        return args

    def visit_call_(self, call):
        plan = next((p for p in self.plans if p.producer.same_as(call)), None)
        if plan is not None:
            gv = self.builder_.add_func(plan.producer_kernel, f"{call.args[0].name_hint}_partials")
            out_ty = call.ty_args[0]
            m = out_ty.shape.values[0]
            both = self.builder_.emit(relax.call_tir(
                gv, relax.Tuple(self._args(call, plan.producer_b)),
                [out_ty, relax.TensorType([plan.rows, m], "float32")]))
            self.partials[id(plan)] = self.builder_.emit(relax.TupleGetItem(both, 1))
            return relax.TupleGetItem(both, 0)
        found = next(((p, c) for p in self.plans for c in p.consumers if c[0].same_as(call)), None)
        if found is None:
            return super().visit_call_(call)
        plan, (_user, kernel, in_loop, swap) = found
        args = self._args(call, swap)
        args[in_loop.rstd] = self.partials[id(plan)]  # mean's argument goes (LayerNorm)
        args = [a for i, a in enumerate(args) if i != in_loop.mean]
        gv = self.builder_.add_func(kernel, f"{call.args[0].name_hint}_partial_stats")
        return relax.Call(tvm.ir.Op.get(_CALL_TIR), [gv, relax.Tuple(args)], call.attrs,
                          call.ty_args)


__all__ = ["NAME", "Sm90ProducerRowStats"]
