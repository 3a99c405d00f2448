"""sm_90a GEMM + epilogue: fused GEMM PrimFuncs become TIRx kernels (TMA, mbarriers, wgmma).

``Sm90Gemm`` is a module pass that runs before the dlight rules (``pipeline.lower`` stage
``gemm_sm90``), for targets with arch ``sm_90a`` only. For every PrimFunc that
:func:`.hopper.epilogue.analyze` reads as ``out[i, j] = f(Σ_k A[i, k]·B[·,·], params)`` it
generates the warp-specialised kernel of :mod:`.hopper.kernel` with ``f`` applied to the
accumulators in registers, keeping the function's signature, and tags it

* ``tirx.is_scheduled`` (dlight leaves it alone), ``tvmfuse.rule = "gemm_sm90"``,
* ``tvmfuse.tirx`` (the build lowers it with TVM's ``tirx`` pipeline, see :func:`hybrid_pipeline`).

A GEMM-like function the kernel cannot take (batched B, prologue on A, K not a multiple of 8, …)
keeps its s_tir body for the sm80 / dlight rules and gets ``tvmfuse.fallback = <reason>``.

Build: one TIR pipeline runs per ``relax.build``; :data:`HYBRID_PIPELINE` (:func:`hybrid_pipeline`,
registered by ``tvm_setup.register_tvm_patches``) sends
``tvmfuse.tirx`` functions through ``tirx`` and everything else through ``s_tir`` (both share the
same host/device finalisation passes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.s_tir import ScheduleError

from ..attrs import (
    CONFIG_ATTR,
    FALLBACK_ATTR,
    KERNEL_TILE_ATTR,
    REPLACES_ATTR,
    RULE_ATTR,
    TIRX_ATTR,
    TUNING_ATTR,
)
from ..device_props import device_properties
from ..kernels.gemm.epilogue import FusedGemm, NotHandled, analyze, expr_value, top_blocks
from ..kernels.gemm.opmath import fast_math16, opmath
from ..kernels.gemm.sm90 import GemmConfig, GemmProblem, KernelTail, RowStats, check, gemm_kernel
from ..kernels.tir_util import Load, dtype_of, strip_cast
from ..options import current_options
from ..passes import weight_arrays
from ..passes._util import const_array
from ..relax_shapes import symbol_ranges, upper_bound
from .weight_twins import TransposedTwins

NAME = "gemm_sm90"
HYBRID_PIPELINE = "tvmfuse_hybrid"


def is_sm90a(target) -> bool:
    return target is not None and target.kind.name == "cuda" and str(
        target.attrs.get("arch", "")) == "sm_90a"


def _looks_like_gemm(func: tirx.PrimFunc) -> bool:
    """A top-level reduction block ``C = C + x[..] * y[..]`` over two different ≥2-D buffers."""
    try:
        _, blocks = top_blocks(func)
    except ScheduleError:  # no root block (not block-structured): not ours
        return False
    for block, _ in blocks:
        body = block.body
        if not (any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars)
                and isinstance(body, tirx.BufferStore) and isinstance(body.value, tirx.Add)
                and isinstance(body.value.b, tirx.Mul)):
            continue
        x, y = strip_cast(body.value.b.a), strip_cast(body.value.b.b)
        if isinstance(x, Load) and isinstance(y, Load) and not x.source.same_as(y.source) \
                and len(x.indices) >= 2 and len(y.indices) >= 2:
            return True
    return False


def select_config(m: int, n: int, sms: int | None = None, layout: str = "nt") -> GemmConfig:
    """Tile for an (M, N) output: 128×256 for large outputs, 128×128 when N is small, 128×192 or
    128×176 (no cluster) when it fills the last wave much better (:func:`_wave_cost`); the
    persistent grid has one CTA per SM (``sms``, None: the current target's, :mod:`.device_props`).

    128×176, fp16 on the H200 (``sm90_gemm_probe.py``, one sweep each, vs 128×256 with a cluster
    of 2): the 4-layer LM's gate/up pair 2048×11264×2048 0.1542 vs 0.1619 ms (with a cluster
    128×176 was 0.1676), 2048×11008×4096 0.2663 vs 0.2843, 2048×5632×2048 0.0809 vs 0.0949; the
    7B's pair (N = 22016, same wave cost) keeps 128×256.

    With at least two row tiles, CTA pairs share their B tile (cluster of 2, TMA multicast) and
    one lane per warp frees a stage: 4096³ fp16 0.1979 → 0.1958 ms, 8192×8192×4096 0.814 → 0.796
    ms on the H200 (kernel alone, one run; tools/bench/NOTES.md "Session 5").
    """
    pair = {"cluster_m": 2, "warp_release": True} if m > 128 else {}
    sms = sms or device_properties().sms
    if n <= 128:
        return GemmConfig(bn=128, stages=6, num_sms=sms, **pair)
    more_than_a_wave = -(-m // 128) * -(-n // 256) > sms  # else the tiles' size is what counts
    if more_than_a_wave and _wave_cost(m, n, 192, sms) < 0.9 * _wave_cost(m, n, 256, sms):
        return GemmConfig(bn=192, stages=5, num_sms=sms)
    if (more_than_a_wave and layout == "nt"  # (K, N) B comes in 64-column chunks
            and _wave_cost(m, n, 176, sms) < 0.95 * _wave_cost(m, n, 256, sms)):
        return GemmConfig(bn=176, stages=5, num_sms=sms)
    return GemmConfig(num_sms=sms, **pair)


def _wave_cost(m: int, n: int, bn: int, sms: int) -> int:
    """Waves of 128×bn tiles over ``sms`` SMs × bn: the persistent kernel's time in units of a
    column of work. 128×192 tiles win where 128×256 leave the last wave mostly empty: QKV of the
    4-layer LM, 2048×3072×2048 fp16 on the H200, 0.0559 → 0.0430 ms (one sweep,
    ``sm90_gemm_probe.py --sweep``; its other shapes keep 128×256, which was fastest there)."""
    tiles = -(-m // 128) * -(-n // bn)
    return -(-tiles // sms) * bn


def gemm_problem(func: tirx.PrimFunc) -> GemmProblem:
    """The :class:`GemmProblem` of a fused GEMM function (raises NotHandled when it is none)."""
    g = analyze(func)
    return GemmProblem(g.m, g.n, g.k, g.in_dtype, g.out_dtype, g.layout)


def static_config(func: tirx.PrimFunc, m: int, n: int, layout: str) -> GemmConfig:
    """The tile of a static-M GEMM: a tuning record's, else :func:`select_config`'s."""
    return gemm_config_of(func) or select_config(m, n, layout=layout)


def gemm_config_of(func: tirx.PrimFunc) -> GemmConfig | None:
    """The :class:`GemmConfig` a tuning record put on ``func`` (None: choose the default)."""
    if func.attrs is None or CONFIG_ATTR not in func.attrs:
        return None
    return GemmConfig(**json.loads(str(func.attrs[CONFIG_ATTR])))


@dataclass(frozen=True)
class InLoopStats:
    """Row statistics of A that the kernel computes instead of reading them from parameters.

    ``mean`` / ``rstd``: positions of the (M, 1) fp32 parameters the epilogue reads them from
    (``mean`` None for RMSNorm); the kernel drops these parameters.
    """

    stats: RowStats
    mean: int | None
    rstd: int

    @property
    def dropped(self) -> list[int]:
        return [i for i in (self.mean, self.rstd) if i is not None]


def kernel_signature(func: tirx.PrimFunc, g: FusedGemm, expr: tvm.ir.PrimExpr, b_transposed: bool,
                     in_loop: InLoopStats | None):
    """What a generated GEMM kernel replacing ``func`` takes, shared by the GEMM generators' rules:
    ``(buffers, (a, b, out) positions, store_value, pair_value)``.

    buffers: ``func``'s parameters renamed ``p<i>``, 16-byte aligned, B as (N, K) when
    ``b_transposed`` turns an "nn" read around, without the row-statistics parameters that
    ``in_loop`` computes (with ``in_loop.stats.partials``, rstd's place holds the partial sums).
    ``store_value(acc, row, col, stats, loads=None)`` / ``pair_value(acc, acc_odd, row, col,
    stats, loads=None)`` (None without a pair epilogue) evaluate ``expr``, the epilogue, at
    one output (``loads``: an :data:`~..kernels.gemm.epilogue.LoadHook`).
    """
    params = list(func.params)
    shapes = [tuple(int(d) if isinstance(d, tirx.IntImm) else d for d in b.shape) for b in params]
    if b_transposed and g.layout == "nn":
        shapes[g.b] = shapes[g.b][::-1]
    new = [tirx.decl_buffer(shape, str(b.dtype), name=f"p{i}", data_alignment=16)
           for i, (b, shape) in enumerate(zip(params, shapes))]
    row_values, positions, kept = [], (g.a, g.b, g.out), list(range(len(params)))
    if in_loop is not None:
        for i in in_loop.dropped:
            if i in positions or (shapes[i], str(params[i].dtype)) != ((g.m, 1), "float32"):
                raise NotHandled(f"parameter {i} is not an (M, 1) fp32 row statistic")
        row_values = [(params[i], k) for k, i in enumerate((in_loop.mean, in_loop.rstd))
                      if i is not None]
        if in_loop.stats.partials:  # rstd's place: the producer's partials; mean's goes
            rows = in_loop.stats.partials * (2 if in_loop.stats.centered else 1)
            new[in_loop.rstd] = tirx.decl_buffer((rows, g.m), "float32", name=f"p{in_loop.rstd}",
                                                 data_alignment=16)
            kept = [i for i in kept if i != in_loop.mean]
        else:
            kept = [i for i in kept if i not in in_loop.dropped]
        positions = tuple(kept.index(i) for i in positions)
    buffers = [(params[i], new[i]) for i in kept]

    def build(names: list, stats, loads=None) -> tvm.ir.Expr:
        row_loads = ((g.dims[0], [(b, stats[k]) for b, k in row_values]) if in_loop is not None
                     else None)
        return expr_value(expr, names, buffers, row_loads, loads)

    def store_value(acc, row, col, stats, loads=None):
        return build([(g.acc, acc), (g.dims[0], row), (g.dims[1], col)], stats, loads)

    def pair_value(acc, acc_odd, row, col, stats, loads=None):
        return build([(g.acc, acc), (g.acc_odd, acc_odd), (g.dims[0], row), (g.dims[1], col)],
                     stats, loads)

    return [new[i] for i in kept], positions, store_value, (
        pair_value if g.acc_odd is not None else None)


# symbolic M: one kernel per bucket of rows, chosen at run time (decode-size, medium, the rest)
M_BUCKETS = (64, 512)


def bucket_configs(hi: int, n: int, sms: int | None = None, layout: str = "nt"
                   ) -> list[tuple[int, GemmConfig]]:
    """``(largest M, tile)`` per bucket of a symbolic M of at most ``hi`` rows, in order:
    64-row tiles (one consumer warpgroup, 128 columns: more CTAs on a thin A) up to 64 rows, then
    :func:`select_config` at the bucket's largest M."""
    sms = sms or device_properties().sms
    tops = [u for u in M_BUCKETS if u < hi] + [hi]
    return [(u, GemmConfig(bm=64, bn=128, stages=6, num_sms=sms) if u <= 64
             else select_config(u, n, sms, layout)) for u in tops]


def build_kernel(func: tirx.PrimFunc, cfg: GemmConfig | None = None,
                 b_transposed: bool = False, in_loop: InLoopStats | None = None,
                 ranges: dict[str, tuple[int, int]] | None = None,
                 partials_out: bool = False, partials_centered: bool = False) -> tirx.PrimFunc:
    """The TIRx kernel replacing ``func``; raises :class:`NotHandled` with the reason.

    ``b_transposed``: ``func`` reads B as (K, N) but the kernel takes B's transpose (N, K)
    instead (the caller drops the transpose kernel that produced B).
    ``in_loop``: the kernel computes A's row statistics in its main loop; its signature is
    ``func``'s without the statistics parameters.
    ``ranges``: the symbols' ranges (:func:`.relax_shapes.symbol_ranges`). A symbolic M bounded
    by them gets one kernel per :func:`bucket_configs` bucket in one function, which branches on
    M at run time (each branch its own launch).
    ``partials_out``: the kernel also writes the row partial sums of squares of its output, an
    (⌈N / BN⌉, M) fp32 parameter after ``func``'s (:func:`partials_of` gives the count;
    ``gemm_kernel(row_partials_out=...)``); ``partials_centered``: each column tile's row mean and
    M2 instead, a (2·⌈N / BN⌉, M) one (LayerNorm).
    """

    g = analyze(func, symbolic_m=in_loop is None and ranges is not None)
    layout = g.layout
    if b_transposed:
        if g.layout != "nn":
            raise NotHandled("B is already (N, K)")
        layout = "nt"
    if g.tail is not None:
        cfg = cfg or tail_config(g)
        if cfg is None:
            raise NotHandled("gather tail: no tile width divides its column ranges")
    if isinstance(g.m, int):
        cfg = cfg or static_config(func, g.m, g.n, layout)  # a record's first
        buckets, rows = [(g.m, cfg)], None
    else:
        hi = upper_bound(g.m, ranges)
        if hi is None:
            raise NotHandled(f"symbolic M={g.m} without an upper bound (--dynamic S=LO..HI)")
        buckets, rows = bucket_configs(hi, g.n, layout=layout), g.m
    if in_loop is not None and current_options().sm90_stats_warps:  # two producer warps sum rows
        buckets = [(top, replace(c, stats_warps=True)) for top, c in buckets]
    for top, c in buckets:
        reason = check(GemmProblem(top, g.n, g.k, g.in_dtype, g.out_dtype, layout), c,
                       in_loop.stats if in_loop is not None else None)
        if reason:
            raise NotHandled(reason)
    if g.acc_odd is not None and g.n % 4:
        raise NotHandled(f"pair epilogue with N/2={g.n // 2} odd (pairs of outputs are stored "
                         "together)")
    if not current_options().sm90_vector_operands:
        buckets = [(top, replace(c, vector_operands=False)) for top, c in buckets]

    cfg = buckets[-1][1]
    expr = opmath(g.expr, g.out_dtype)  # the whole chain in fp32 on the accumulator, one rounding
    if cfg.fast_math16 and g.out_dtype in ("float16", "bfloat16"):
        expr = fast_math16(expr)
    buffers, positions, store_value, pair_value = kernel_signature(func, g, expr, b_transposed,
                                                                   in_loop)
    partials_in = None
    if in_loop is not None and in_loop.stats.partials:  # rstd's position once mean's is gone
        partials_in = in_loop.rstd - int(in_loop.mean is not None and in_loop.mean < in_loop.rstd)
    partials_pos = None
    if partials_out:
        if rows is not None or g.acc_odd is not None or len(g.out_shape) != 2:
            raise NotHandled("row partial sums need a static M and a plain (M, N) output")
        p_rows = -(-g.n // cfg.bn) * (2 if partials_centered else 1)
        buffers = [*buffers, tirx.decl_buffer((p_rows, g.m), "float32", name="row_partials",
                                              data_alignment=16)]
        partials_pos = len(buffers) - 1
    kernel_tail = None
    if g.tail is not None:
        if rows is not None or partials_out:
            raise NotHandled("a gather tail with a symbolic M or row partial sums")
        kernel_tail = _kernel_tail(g, store_value, buffers, func)
    try:
        kernels = [gemm_kernel(GemmProblem(top, g.n, g.k, g.in_dtype, g.out_dtype, layout), c,
                               buffers, *positions, store_value, pair_value,
                               row_stats=in_loop.stats if in_loop is not None else None, rows=rows,
                               row_partials_in=partials_in, row_partials_out=partials_pos,
                               partials_centered=partials_centered, tail=kernel_tail)
                   for top, c in buckets]
    except ValueError as err:
        if partials_in is None and partials_pos is None and kernel_tail is None:
            raise
        raise NotHandled(str(err)) from err
    kernel = kernels[-1]
    if len(kernels) > 1:  # if M <= top_0: kernel 0 elif M <= top_1: kernel 1 … else the last
        body = kernel.body
        for (top, _), k in zip(buckets[-2::-1], kernels[-2::-1]):
            body = tirx.IfThenElse(tirx.LE(rows, tirx.IntImm(dtype_of(rows), top)), k.body, body)
        kernel = tirx.PrimFunc(kernel.params, body, attrs=kernel.attrs)
    tiles = " | ".join(f"{c.bm}x{c.bn}x64 stages={c.stages}" + (f" (M<={top})" if rows is not None
                                                                 else "") for top, c in buckets)
    attrs = {"tirx.is_scheduled": True, RULE_ATTR: NAME, TIRX_ATTR: True,
             KERNEL_TILE_ATTR: tiles}
    if func.attrs is not None and TUNING_ATTR in func.attrs:  # tuned / default label stays
        attrs[TUNING_ATTR] = func.attrs[TUNING_ATTR]
    return kernel.with_attrs(attrs)


def tail_config(g: FusedGemm, sms: int | None = None) -> GemmConfig | None:
    """The tile of a GEMM with a gather tail: 128 or 256 columns (whichever fills the waves
    better, :func:`_wave_cost`) dividing N and every column range's start, a multiple of the
    RoPE pair's span 2·half; None when neither does."""
    sms = sms or device_properties().sms
    fits = [bn for bn in (256, 128) if g.n % bn == 0 and bn % (2 * max(g.tail.half, 8)) == 0
            and all(seg.j0 % bn == 0 for seg in g.tail.segments)]
    if not fits:
        return None
    bn = min(fits, key=lambda b: (_wave_cost(g.m, g.n, b, sms), -b))
    pair = {"cluster_m": 2, "warp_release": True} if g.m > 128 else {}
    return GemmConfig(bn=bn, stages=6 if bn == 128 else 4, num_sms=sms, **pair)


def _kernel_tail(g: FusedGemm, store_value, buffers: list, func: tirx.PrimFunc) -> KernelTail:
    """The kernel's view of ``g.tail``: each range's value over the accumulators, the GEMM's own
    epilogue (``store_value``) making C[row, col] and C[row, col ^ half] first."""
    tail = g.tail
    pairs = _tail_buffers(func, buffers)

    def value(acc, acc_partner, row, col, stats, k):
        partner_col = col + tail.half - 2 * tail.half * ((col // max(tail.half, 1)) % 2) \
            if tail.half else col
        names = [(tail.own, store_value(acc, row, col, stats)),
                 (tail.partner, store_value(acc_partner, row, partner_col, stats)),
                 (g.dims[0], row), (g.dims[1], col)]
        return expr_value(tail.segments[k].expr, names, pairs)

    return KernelTail(tuple((s.j0, s.width, s.base, s.stride) for s in tail.segments), tail.half,
                      tail.size, value)


def _tail_buffers(func: tirx.PrimFunc, buffers: list) -> list:
    """``(func parameter, kernel buffer)`` by name (``p<i>``: kernel_signature's renaming)."""
    params = list(func.params)
    return [(params[int(b.name[1:])], b) for b in buffers if b.name[1:].isdigit()]


def partials_of(func: tirx.PrimFunc, b_transposed: bool = False) -> tuple[int, int]:
    """(column tiles, their width) :func:`build_kernel` gives ``func``'s (static M) output: what
    its ``partials_out`` rows cover."""
    g = analyze(func)
    cfg = static_config(func, g.m, g.n, "nt" if b_transposed else g.layout)
    return -(-g.n // cfg.bn), cfg.bn


def _is_transpose(func: tirx.PrimFunc) -> bool:
    """``out[i, j] = in[j, i]`` over 2-D buffers of one dtype, nothing else."""
    params = list(func.params)
    if len(params) != 2 or len(params[0].shape) != 2:
        return False
    try:
        _, blocks = top_blocks(func)
    except ScheduleError:  # no root block (not block-structured)
        return False
    if len(blocks) != 1:
        return False
    body = blocks[0][0].body
    ivs = [iv.var for iv in blocks[0][0].iter_vars]
    v = body.value if isinstance(body, tirx.BufferStore) else None
    return (isinstance(v, Load) and v.source.same_as(params[0]) and body.buffer.same_as(params[1])
            and len(ivs) == 2 and str(params[0].dtype) == str(params[1].dtype)
            and all(a.same_as(b) for a, b in zip(body.indices, ivs))
            and all(a.same_as(b) for a, b in zip(v.indices, ivs[::-1])))


@mutator
class _DropTransposes(PyExprMutator):
    """:func:`_drop_weight_transposes`' mutator."""

    def __init__(self, mod: tvm.IRModule, kernels: dict, ranges: dict[str, tuple[int, int]],
                 prefer_nt: set) -> None:
        super().__init__(mod)
        self.kernels, self.ranges, self.prefer_nt = kernels, ranges, prefer_nt
        self.made: dict = {}
        self.twins = TransposedTwins(mod)

    def visit_call_(self, call):
        call_tir = tvm.ir.Op.get("relax.call_tir")
        call = super().visit_call_(call)
        if call.op != call_tir or call.args[0] not in self.kernels:
            return call
        gv = call.args[0]
        b_pos = self.kernels[gv]
        args = list(call.args[1].fields)
        if b_pos is None:
            return call
        if isinstance(args[b_pos], tvm.ir.expr.Constant):  # the decode GEMV's (N, K) copy
            source = self.twins.of(args[b_pos])
            if source is None and gv in self.prefer_nt and self.twins.uses.get(hash(args[b_pos])) == 1:
                w = const_array(args[b_pos])  # read by this call alone: its transpose replaces it
                source = None if w is None else weight_arrays.constant(weight_arrays.transpose(w))
        else:
            producer = self.lookup_binding(args[b_pos]) if isinstance(args[b_pos], relax.Var) else None
            source = producer.args[1].fields[0] if (
                isinstance(producer, relax.Call) and producer.op == call_tir
                and isinstance(self.builder_.get()[producer.args[0]], tirx.PrimFunc)
                and _is_transpose(self.builder_.get()[producer.args[0]])) else None
        if source is None:
            return call
        if gv not in self.made:
            try:
                kernel = build_kernel(self.builder_.get()[gv], b_transposed=True,
                                      ranges=self.ranges)
            except NotHandled:
                self.made[gv] = None
                return call
            # the report finds the fused function's ops through the name it replaces
            old_attrs = self.builder_.get()[gv].attrs
            replaces = (str(old_attrs[REPLACES_ATTR]) if old_attrs and REPLACES_ATTR in old_attrs
                        else gv.name_hint)
            self.made[gv] = self.builder_.add_func(kernel.with_attr(REPLACES_ATTR, replaces),
                                                   f"{gv.name_hint}_nt")
        if self.made[gv] is None:
            return call
        args[b_pos] = source
        return relax.Call(call_tir, [self.made[gv], relax.Tuple(args)], call.attrs, call.ty_args)


def _drop_weight_transposes(mod: tvm.IRModule, kernels: dict,
                            ranges: dict[str, tuple[int, int]], prefer_nt: set) -> tvm.IRModule:
    """``gemm(.., transpose(w), ..)`` → ``gemm_nt(.., w, ..)`` for the kernels just generated.

    The GEMM then reads W (N, K) K-major, the layout wgmma prefers, and the transpose kernel
    (a full pass over W) disappears when nothing else uses its result. Likewise a constant (K, N)
    B whose transpose the module already holds (:mod:`.weight_twins`: the decode GEMV's copy)
    is replaced by that copy, so the weight is stored once. For the kernels in ``prefer_nt``
    (whose (N, K) B gets a better tile, :func:`select_config`) a constant (K, N) B that nothing
    else reads is replaced by its transpose, made at compile time.
    """
    rewriter = _DropTransposes(mod, kernels, ranges, prefer_nt)
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    mod = rewriter.builder_.get()
    if any(v is not None for v in rewriter.made.values()):
        mod = relax.transform.DeadCodeElimination()(mod)
    return mod


@tvm.transform.module_pass(opt_level=0, name="Sm90Gemm")
def Sm90Gemm(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - pass names are CamelCase
    """Replace fused GEMM PrimFuncs by TIRx wgmma kernels when the current target is sm_90a."""
    target = tvm.target.Target.current(allow_none=True)
    if not is_sm90a(target):
        return mod
    mod = mod.clone()  # assigned into below: not the caller's module
    updates, kernels, prefer_nt = {}, {}, set()
    ranges = symbol_ranges(mod)
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get("tirx.is_scheduled"):
            continue
        if not _looks_like_gemm(func):
            continue
        try:
            g = analyze(func, symbolic_m=True)
            kernels[gv] = g.b if g.layout == "nn" else None
            if (g.layout == "nn" and isinstance(g.m, int) and gemm_config_of(func) is None
                    and select_config(g.m, g.n, layout="nt") != select_config(g.m, g.n, layout="nn")):
                prefer_nt.add(gv)
        except NotHandled:
            pass
        try:
            updates[gv] = build_kernel(func, ranges=ranges)
        except NotHandled as why:
            updates[gv] = func.with_attr(FALLBACK_ATTR, f"{NAME}: {why}")
            kernels.pop(gv, None)
    # (K, N) weights made by a transpose kernel: read the (N, K) original instead (before the
    # PrimFuncs are swapped: the rewrite analyses the s_tir bodies)
    mod = _drop_weight_transposes(mod, kernels, ranges, prefer_nt)
    for gv, func in updates.items():
        if gv in mod.get_global_vars():
            mod[gv] = func
    return mod


def uses_tirx(mod: tvm.IRModule) -> bool:
    """True when some PrimFunc of ``mod`` must be lowered by the tirx pipeline."""
    return any(isinstance(f, tirx.PrimFunc) and f.attrs.get(TIRX_ATTR)
               for _, f in mod.functions_items())


def hybrid_pipeline():
    """TIR pipeline factory: ``tvmfuse.tirx`` functions through tirx, the rest through s_tir."""
    s_tir_pass, finalize_host, finalize_device = tirx.get_tir_pipeline("s_tir")
    tirx_pass, _, _ = tirx.get_tir_pipeline("tirx")

    @tvm.transform.module_pass(opt_level=0, name="TvmfuseHybridTIR")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mine = {gv: f for gv, f in mod.functions_items()
                if isinstance(f, tirx.PrimFunc) and f.attrs.get(TIRX_ATTR)}
        if not mine:
            return s_tir_pass(mod)
        rest = {gv: f for gv, f in mod.functions_items() if gv not in mine}
        out = s_tir_pass(tvm.IRModule(rest, attrs=mod.attrs)) if rest else \
            tvm.IRModule({}, attrs=mod.attrs)
        lowered = tirx_pass(tvm.IRModule(mine, attrs=mod.attrs))
        out.update(lowered)
        return out

    return _pipeline, finalize_host, finalize_device
