"""Tensor-core GEMM with a fused epilogue for sm_80+ (mma.sync m16n8k16, cp.async, ldmatrix).

Takes a fused PrimFunc with exactly one reduction block of the form

    C[s, i, j] += f32(A[s, i, k]) · f32(B[s, j, k])      (or B[s, k, j]; s = batch dims or none)

(A, B fp16 or bf16, C fp32) followed by spatial epilogue blocks that read ``C`` elementwise:
bias ``b[j]``, GELU / ReLU / SiLU·gate, a residual ``r[i, j]``, per-row statistics ``μ[i], σ[i]``
and per-column vectors of the norm-prologue form (``tvmfuse/passes/norm_gemm.py``), casts. Dims
are normalised like dlight's MatmulTensorization (``reindex`` + ``transform_layout`` to
``[S, I, K] × [S, J, K]`` or ``[S, K, J]``), so Linear weights ``(N, K)``, plain ``(K, N)``
weights, a 3-D activation against a 2-D weight (folded into M) and batched matmul are all one
form; ``pad_einsum`` pads a ragged M, N or K to the tile (zero-filled predicated loads).

Schedule, per thread block of ``block_m × block_n`` outputs and ``warps = (block_m / warp_m) ·
(block_n / warp_n)`` warps, each computing ``warp_m × warp_n``::

    blockIdx.x  grouped raster: ``raster`` M-tiles per N-tile column, for L2 reuse of B and A
    blockIdx.y  batch
    acc[warp_m/16, warp_n/16] m16n16 fp32 fragments = 0                       (registers)
    for k0 in K / block_k:                      software pipeline, ``stages`` deep, cp.async
        A_s[block_m, block_k], B_s[...] ← global (16-byte cp.async, rows padded by 8 halves:
                                                 ldmatrix rows land in distinct bank groups)
        for k1 in block_k / 16:                 fragments double-buffered in registers
            A_f ← ldmatrix.x4(A_s); B_f ← ldmatrix.x4[.trans](B_s)
            acc += mma.sync.m16n8k16(A_f, B_f)
    C_s[warp tile] ← acc                        (shared, fp32, per warp, rows padded by 8 floats)
    out[i, j..j+V] = epilogue(C_s[i, j..j+V], bias, residual, …)   one V-wide store per lane

The epilogue runs on the fp32 accumulators, read back from shared memory in 16-byte vectors
(``V`` = ``Options.sm80_epilogue_lane_elems`` = 4: a quarter-warp's reads cover one 128-byte row
piece, no bank conflict), computed in scalar registers, stored ``V`` outputs at a time. With
``Options.sm80_epilogue_from_registers`` (off by default; an experiment of session 5, NOTES.md)
the epilogue runs on the mma fragments themselves and each lane stores pairs of outputs
(``half2``), with no shared-memory staging; where that does not schedule (a padded, ragged C)
the staged epilogue is used.

With ``GemmConfig.one_barrier`` (stages ≥ 3) the K loop has one ``__syncthreads`` per tile: a pass
run after TVM's ThreadSync (:func:`_one_barrier_loop`) drops the barrier ThreadSync puts before
the refill and moves the ``cp.async.wait_group`` + barrier behind the tile's k-steps, so one
barrier guards both the refill and the next tile's reads, and each tile's loads get two tiles
of compute to land instead of one.

Tile choices are plain parameters (:class:`GemmConfig`) so that tuning can vary them. By default
(:meth:`GemmSM80.pick_config`) a GEMM whose grid of 256×128 tiles has at least one block per
SM of the target (:mod:`tvmfuse.device_props`: 132 on the H200, 108 on an A100) takes
:data:`LARGE_CONFIG` (256×128×64, 8 warps of 64×64, 4 stages, one barrier per K tile: the fastest
tile measured on the H200, see tools/bench/NOTES.md; 3 stages where shared memory per block is
163 KB as on an A100), a smaller one :data:`DEFAULT_CONFIG` (128×128×64, 4 warps, 2 blocks per
SM). M ≤ ``SMALL_M`` (decode) uses
:data:`SMALL_M_CONFIG` (a 16 × 32 tile of 2 warps, K steps of 128) instead of padding M to 128:
measured at cuBLAS speed for M = 8 / 16 (tools/bench/NOTES.md). M = 1 has no M axis, so it is
no GEMM to this rule (``None``): dlight's GEMV rule takes it.

Falls back — delegating to dlight's GEMV / Matmul rules and marking the PrimFunc with
``"tvmfuse.fallback" = reason`` — for GEMMs outside this form: other dtypes, fp16 accumulation,
a transposed A, K or N not a multiple of 8, symbolic shapes. Non-GEMM functions return ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.s_tir.dlight.gpu.matmul import (
    IterKind,
    auto_inline_consumer_chain,
    auto_inline_producers,
    detect_iter_traits,
    get_reduction_blocks,
    make_iter_fusion_index_map,
)
from tvm.target import Target

from ..attrs import FALLBACK_ATTR, RULE_ATTR, TILE_ATTR
from ..device_props import DeviceProperties, device_properties
from ..kernels.tir_util import const_int
from ..options import Options, current_options
from ..tvmscript_frames import cuda_tensor_intrinsics
from .elementwise import VECTOR_BYTES
from .guarded_gemv import GuardedGEMV

NAME = "gemm_sm80"
WARP = 32
MMA = 16  # the m16n16k16 fragment that ldmatrix.x4 + two mma.sync.m16n8k16 compute
SMALL_M = 16  # M up to this uses SMALL_M_CONFIG


@dataclass(frozen=True)
class GemmConfig:
    """A thread-block tile: ``block_m × block_n`` outputs, K steps of ``block_k``, warps of
    ``warp_m × warp_n`` outputs, a ``stages``-deep cp.async pipeline, ``raster`` M-tiles per
    group of the block order (1 = row-major)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    warp_m: int = 64
    warp_n: int = 64
    stages: int = 3
    raster: int = 8
    one_barrier: bool = False  # one __syncthreads per K tile (:func:`_one_barrier_loop`), stages ≥ 3

    @property
    def tag(self) -> str:
        """``BMxBNxBKwWMxWNsS rR [b1]`` in one word, as tools/device/sm80_gemm_probe.py parses it."""
        return (f"{self.block_m}x{self.block_n}x{self.block_k}w{self.warp_m}x{self.warp_n}"
                f"s{self.stages}r{self.raster}{'b1' if self.one_barrier else ''}")

    @property
    def warps(self) -> int:
        return (self.block_m // self.warp_m) * (self.block_n // self.warp_n)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the A and B stage ring (rows padded by 8 halves); the fp32
        C staging reuses it after the main loop."""
        return self.stages * (self.block_m + self.block_n) * (self.block_k + 8) * 2

    def check(self) -> None:
        """Raise ValueError for a tile the schedule cannot build."""
        for name in ("warp_m", "warp_n", "block_k"):
            if getattr(self, name) % MMA:
                raise ValueError(f"{name}={getattr(self, name)} is not a multiple of {MMA}")
        if self.block_m % self.warp_m or self.block_n % self.warp_n:
            raise ValueError(f"warp tile {self.warp_m}x{self.warp_n} does not divide the block "
                             f"tile {self.block_m}x{self.block_n}")
        if self.stages < 2 or self.raster < 1:
            raise ValueError("stages must be >= 2 and raster >= 1")


# 4 warps of 64×64 (2 blocks/SM); taken when LARGE_CONFIG would leave SMs idle.
DEFAULT_CONFIG = GemmConfig(one_barrier=True)
# 8 warps of 64×64 in a 256×128 tile (1 block/SM, 221 KB shared with 4 stages): with one barrier
# per K tile 0.320 ms at 4096³ fp16 on the H200 against 0.383 for DEFAULT_CONFIG (3 stages,
# session 4); 4 stages 0.3077 vs 0.3120 ms for 3 with padded C rows (sm80_6, tools/bench/NOTES.md).
# Taken when its grid has at least one block per SM of the target (device_props: 132 on the H200,
# 108 on an A100), with stages cut to what shared memory per block holds (3 on an A100: 163 KB).
LARGE_CONFIG = GemmConfig(block_m=256, stages=4, one_barrier=True)
# Decode (M ≤ SMALL_M): the weight stream dominates; narrow N tiles give more blocks to stream it.
SMALL_M_CONFIG = GemmConfig(block_m=16, block_n=32, block_k=128, warp_m=16, warp_n=16, stages=4,
                            raster=1)

_IN_DTYPES = ("float16", "bfloat16")
# The epilogue's A/B switches (fp32 accumulator row padding ``sm80_c_row_pad``: a warp's fragment
# store then puts each half-warp's 64-bit stores in 32 distinct banks, unpadded 128-float rows land
# on the same 8 banks; ``sm80_epilogue_lane_elems`` = 4: one 16-byte read per lane and vector,
# 8-byte fp16 stores, H200 4096³ 0.3094 vs 0.3120 ms for 16 bytes of the output dtype;
# ``sm80_epilogue_from_registers``) are fields of :class:`tvmfuse.options.Options`.


def _fit_stages(cfg: GemmConfig, k: int) -> GemmConfig:
    """``cfg`` with at most ``k_tiles + 1`` stages: TVM's software pipeline needs ``stages - 1``
    K tiles to fill its prologue, else ``cp.async.wait_group`` keeps a non-constant count and
    CUDA codegen fails (K = 64 with 64-wide K tiles, K = 256 with the decode tile's 4 stages)."""
    k_tiles = -(-k // cfg.block_k)
    if k_tiles >= cfg.stages - 1:
        return cfg
    return replace(cfg, stages=max(2, k_tiles + 1))


def _fit_smem(cfg: GemmConfig, smem_per_block: int) -> GemmConfig:
    """``cfg`` with stages cut (not below 2) until its ring fits ``smem_per_block`` bytes."""
    while cfg.smem_bytes > smem_per_block and cfg.stages > 2:
        cfg = replace(cfg, stages=cfg.stages - 1)
    return cfg

# TIR build options a module with these kernels must be built with (``pipeline.build`` does):
# cp.async is emitted only with use_async_copy; CSE hoists ``threadIdx.x * 8`` out of the
# ldmatrix offsets, after which LowerWarpMemory cannot find the lane coefficient of the A/B
# fragments ("require positive constant coefficient on warp index").
BUILD_CONFIG = {"tirx.use_async_copy": True, "tirx.disable_cse_tir": True}


# ---------------------------------------------------------------------------------------------
# intrinsics


def _retyped(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The fp16 intrinsic ``func`` with every fp16 operand made bf16 (same bits: ldmatrix moves
    .b16, mma.sync takes ``bf16`` in place of ``fp16``).

    The printed script drops the element dtype of ``T.ptx_legacy.ldmatrix`` (the call's type),
    and the parser then types the call int8; for a transposing ldmatrix (B as (K, N)) the CUDA
    codegen emits its int8 gather loop instead of ``ldmatrix.trans``, which takes the shared
    offset for a stride and reads far outside shared memory (an illegal memory access). Each
    ldmatrix call is therefore retyped bf16 after parsing.
    """
    text = func.script()
    text = text.replace('"float16"', '"bfloat16"').replace("T.float16", "T.bfloat16")
    parsed = tvm.script.from_source(text.replace('"fp16"', '"bf16"'))

    def ldmatrix_bf16(call):
        if getattr(call.op, "name", "") == _LDMATRIX_OP:
            return tirx.call_intrin("bfloat16", call.op, *call.args)
        return call

    return parsed.with_body(tvm_ffi.structural_map(parsed.body, [((tvm.ir.Call,), ldmatrix_bf16)]))


_LDMATRIX_OP = "tirx.ptx_legacy.ldmatrix"


def _intrin(name: str, dtype: str) -> str:
    """The registered tensor intrinsic ``name`` for input ``dtype`` (bf16 ones are made once from
    TVM's fp16 ones, which TVM registers for fp16 only)."""
    if dtype == "float16":
        return name
    new = f"tvmfuse_{name}_bf16"
    if s_tir.TensorIntrin.get(new, allow_missing=True) is None:
        intrin = s_tir.TensorIntrin.get(name)
        s_tir.TensorIntrin.register(new, _retyped(intrin.desc), _retyped(intrin.impl))
    return new


def patch_lower_warp_memory() -> None:
    """Make ``tirx.transform.LowerWarpMemory`` lower every warp buffer, not just the first.

    TVM 0.27's pass rewrites only the first ``warp``-scope allocation of a statement sequence
    (``WarpMemoryRewriter::VisitStmt_(SeqStmtNode)`` breaks after it), so the A and B fragment
    buffers of this schedule, allocated side by side, stayed whole-warp arrays in every thread.
    Repeating the pass until nothing changes lowers them all; the default TIR pipeline looks
    the pass up by attribute at build time, so wrapping it here takes effect there. Idempotent;
    called by :func:`tvmfuse.tvm_setup.register_tvm_patches`, never on import.
    """
    transform = tirx.transform
    original = getattr(transform.LowerWarpMemory, "_tvmfuse_original", transform.LowerWarpMemory)

    @tvm.transform.module_pass(opt_level=0, name="tvmfuse.LowerWarpMemoryRepeated")
    def repeated(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for _ in range(32):  # one warp buffer per round
            lowered = original()(mod)
            if tvm_ffi.structural_equal(lowered, mod):
                break
            mod = _fold_fragment_offsets(lowered)
        return mod

    def lower_warp_memory() -> tvm.transform.Pass:
        return repeated

    lower_warp_memory._tvmfuse_original = original  # type: ignore[attr-defined]
    transform.LowerWarpMemory = lower_warp_memory


def _split_offset(div):
    """``(x + c) / d`` with constants ``c ≥ d > 0`` → ``(x + c % d) / d + c // d``.

    LowerWarpMemory leaves a fragment's register index as ``(tx·8 + 256·g + 4) / 256`` (the
    second m16n8 half of fragment ``g``), which TVM's simplifier does not fold to ``g`` although
    ``tx < 32``; nvcc cannot either, so the accumulators would live in local memory. Split this
    way, ``(tx·8 + 4) / 256`` folds to 0 and the index becomes the constant ``g``.
    """
    a, d = div.a, div.b
    if isinstance(d, tirx.IntImm) and isinstance(a, tirx.Add) and isinstance(a.b, tirx.IntImm):
        c, dv = int(a.b.value), int(d.value)
        if dv > 0 and c >= dv:
            rest = a.a + tirx.IntImm(a.b.ty, c % dv)
            return type(div)(rest, d) + tirx.IntImm(a.b.ty, c // dv)
    return div


def _fold_fragment_offsets(mod: tvm.IRModule) -> tvm.IRModule:
    """:func:`_split_offset` on every device function, then the simplifier."""
    funcs = {}
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            body = tvm_ffi.structural_map(func.body, [((tirx.FloorDiv, tirx.Div), _split_offset)])
            func = func.with_body(body)
        funcs[gvar] = func
    return tirx.transform.StmtSimplify()(tvm.IRModule(funcs, attrs=mod.attrs))



# ---------------------------------------------------------------------------------------------
# one barrier per K tile

ONE_BARRIER_ATTR = "tvmfuse.one_barrier"  # PrimFunc attribute: apply _one_barrier at build


def _is_attr(stmt, key: str) -> bool:
    return isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == key


def _is_sync(stmt) -> bool:
    return (isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.Call)
            and getattr(stmt.value.op, "name", "") == "tirx.tvm_storage_sync")


def _count_syncs(stmt) -> int:
    return sum(1 for e in _nodes(stmt, (tirx.Evaluate,)) if _is_sync(e))


def _drop_leading_sync(commit: tirx.AttrStmt) -> tirx.AttrStmt | None:
    """``commit`` (the async copies of one K tile) without the barrier ThreadSync put at the
    head of its first ``async_scope``; None when that is not its form."""
    scopes = list(commit.body.seq) if isinstance(commit.body, tirx.SeqStmt) else [commit.body]
    first = scopes[0]
    if not _is_attr(first, "async_scope") or not isinstance(first.body, tirx.SeqStmt):
        return None
    head, *rest = first.body.seq
    if not _is_sync(head) or not rest:
        return None
    scopes[0] = tirx.AttrStmt(first.node, first.attr_key, first.value,
                              rest[0] if len(rest) == 1 else tirx.SeqStmt(rest))
    body = scopes[0] if len(scopes) == 1 else tirx.SeqStmt(scopes)
    new = tirx.AttrStmt(commit.node, commit.attr_key, commit.value, body)
    return new if _count_syncs(new) == 0 else None


def _nodes(tree, types: tuple) -> list:
    """Every node of ``types`` in ``tree``."""
    found: list = []
    tvm_ffi.structural_map(tree, [(types, lambda node: found.append(node) or node)])
    return found


def _reads_only_this_tile(stmt, k0: tirx.Var) -> bool:
    """True when ``stmt`` has no barrier and every ring-buffer index in it that involves
    ``k0`` is ``k0 % S`` (this tile's stage), none ``(k0 + c) % S`` of another tile."""
    if _count_syncs(stmt):
        return False
    for mod in _nodes(stmt, (tirx.FloorMod,)):
        a, b = mod.a, mod.b
        if not any(v.same_as(k0) for v in _nodes(a, (tirx.Var,))):
            continue
        if isinstance(a, tirx.Var):
            continue
        if not (isinstance(a, tirx.Add) and isinstance(a.a, tirx.Var) and a.a.same_as(k0)
                and isinstance(a.b, tirx.IntImm) and isinstance(b, tirx.IntImm)
                and int(a.b.value) % int(b.value) == 0):
            return False
    return True


def _one_barrier_loop(loop: tirx.For) -> tirx.For:
    """One ``__syncthreads`` per K tile in the pipelined main loop of this schedule.

    TVM's software pipeline with ThreadSync gives iteration ``i`` (``S`` stages, copies
    ``S - 1`` tiles ahead, the next tile's first fragments loaded at the end)::

        sync; copy tile i+S-1 → stage (i-1)%S; commit; wait(S-2); sync;
        body(i) [k-steps of tile i]; prologue(i+1) [ldmatrix of tile i+1]; epilogue(i)

    The first barrier guards the stage being refilled, last read by ``body(i-1)``; the
    second makes tile ``i+1`` visible, which only ``prologue(i+1)`` needs (``body(i)`` reads
    tile ``i``, waited for and synchronised in iteration ``i-1``). Rewritten to::

        copy tile i+S-1 → stage (i-1)%S; commit; body(i); wait(S-2); sync;
        prologue(i+1); epilogue(i)

    one barrier does both: ``body(i-1)`` ran before iteration ``i-1``'s barrier, so the
    refill after it is safe, and the wait now comes a whole ``body(i)`` later (tile ``i+1``
    was issued one iteration earlier, so its loads have two bodies to land instead of one).
    ``body(i)`` is the run of statements after the barrier whose shared-memory indices name
    stage ``i % S`` only (:func:`_reads_only_this_tile`). Any loop not of this form is
    returned unchanged.
    """
    body = loop.body
    if not isinstance(body, tirx.SeqStmt) or len(body.seq) < 2:
        return loop
    commit, wait, *after = body.seq
    if not (_is_attr(commit, "async_commit_queue_scope")
            and _is_attr(wait, "async_wait_queue_scope")
            and _is_attr(wait.body, "async_wait_inflight_count")):
        return loop
    inflight = wait.body
    inner = list(inflight.body.seq) if isinstance(inflight.body, tirx.SeqStmt) \
        else [inflight.body]
    if not _is_sync(inner[0]):
        return loop
    sync, stmts = inner[0], inner[1:] + after  # the wait scope only prints the wait first
    n = 0
    while n < len(stmts) and _reads_only_this_tile(stmts[n], loop.loop_var):
        n += 1
    if n == 0 or n == len(stmts):
        return loop
    copies = _drop_leading_sync(commit)
    if copies is None:
        return loop
    new_wait = tirx.AttrStmt(wait.node, wait.attr_key, wait.value,
                             tirx.AttrStmt(inflight.node, inflight.attr_key, inflight.value,
                                           tirx.SeqStmt([sync, *stmts[n:]])))
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                    tirx.SeqStmt([copies, *stmts[:n], new_wait]), loop.thread_binding,
                    loop.annotations, loop.step, loop.span)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.OneBarrierPerKTile")
def one_barrier_pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """:func:`_one_barrier_loop` on the loops of every PrimFunc marked ``ONE_BARRIER_ATTR``
    (a copy of ``mod`` with those functions replaced; ``mod`` itself when none is marked)."""
    changed = {}
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and func.attrs and func.attrs.get(ONE_BARRIER_ATTR):
            changed[gvar] = func.with_body(
                tvm_ffi.structural_map(func.body, [((tirx.For,), _one_barrier_loop)]))
    if not changed:
        return mod
    mod = mod.clone()
    for gvar, func in changed.items():
        mod.update_func(gvar, func)
    return mod


def patch_thread_sync() -> None:
    """Run :data:`one_barrier_pass` right after ``ThreadSync("warp")``, the last of the three
    ThreadSync passes of the default s_tir pipeline (which looks the pass up at build time, so
    wrapping the attribute here takes effect there; functions without the mark are untouched).
    Idempotent; called by :func:`tvmfuse.tvm_setup.register_tvm_patches`, never on import."""
    transform = s_tir.transform
    original = getattr(transform.ThreadSync, "_tvmfuse_original", transform.ThreadSync)

    def thread_sync(storage_scope: str) -> tvm.transform.Pass:
        sync = original(storage_scope)
        if storage_scope != "warp":
            return sync
        return tvm.transform.Sequential([sync, one_barrier_pass], name="tvmfuse.ThreadSync")

    thread_sync._tvmfuse_original = original  # type: ignore[attr-defined]
    transform.ThreadSync = thread_sync



# ---------------------------------------------------------------------------------------------
# analysis


@dataclass
class _Gemm:
    """What the analysis found: the matmul block, its layout and its sizes."""

    block: s_tir.schedule.SBlockRV
    dtype: str
    b_kn: bool  # B is read as B[k, j] (contiguous in N) rather than B[j, k]
    m: int
    n: int
    k: int
    batch: int = 1


class _NotThisRule(Exception):
    """The function is a GEMM this rule does not schedule; the message says why."""


def _find_gemm(sch: s_tir.Schedule) -> s_tir.schedule.SBlockRV | None:
    """The single matmul-shaped reduction block, or None when the function is no GEMM."""
    root = sch.get_sblock("root") if _has_root(sch) else None
    blocks = sch.get_child_blocks(root) if root is not None else []
    reductions = get_reduction_blocks(sch, blocks) if blocks else None
    if not reductions:
        return None
    block = reductions[0]
    if detect_iter_traits(sch.get(block)) is None:
        return None
    return block


def _has_root(sch: s_tir.Schedule) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except s_tir.ScheduleError:  # no block named root
        return False


def _analyse(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> _Gemm:
    """Inline the matmul's in-function producers and classify it; raises _NotThisRule."""
    for producer in sch.get_producers(block):
        try:
            sch.compute_inline(producer)
        except s_tir.ScheduleError as err:
            raise _NotThisRule(f"operand producer {sch.get(producer).name_hint} not inlinable") \
                from err
    stmt = sch.get(block)
    traits = detect_iter_traits(stmt)
    if traits is None or len(stmt.reads) != 2:
        raise _NotThisRule("operands are not plain buffer reads")
    a, b = (r.source for r in stmt.reads)
    c = stmt.writes[0].source
    if str(a.dtype) != str(b.dtype) or str(a.dtype) not in _IN_DTYPES:
        raise _NotThisRule(f"operand dtypes {a.dtype}, {b.dtype} (need fp16 or bf16)")
    if str(c.dtype) != "float32":
        raise _NotThisRule(f"accumulator dtype {c.dtype} (need float32)")
    kinds = {iv.var: t.kind for iv, t in zip(stmt.iter_vars, traits[3])}
    sizes: dict[IterKind, int] = {}
    for iv, trait in zip(stmt.iter_vars, traits[3]):
        extent = const_int(iv.dom.extent)
        if extent is None:
            raise _NotThisRule("symbolic shape")
        if trait.kind in (IterKind.kIter_S, IterKind.kIter_I, IterKind.kIter_J,
                          IterKind.kIter_K):
            sizes[trait.kind] = sizes.get(trait.kind, 1) * extent

    def last_kind(region) -> IterKind | None:
        return kinds.get(region[-1].min) if region else None

    if last_kind(stmt.reads[0].region) != IterKind.kIter_K:
        raise _NotThisRule("A is not K-contiguous (transposed A)")
    b_last = last_kind(stmt.reads[1].region)
    if b_last not in (IterKind.kIter_K, IterKind.kIter_J):
        raise _NotThisRule("B's innermost index is neither K nor N")
    if _innermost_split(stmt, kinds):
        raise _NotThisRule("an operand's contiguous dim mixes several loop kinds")
    m, n, k = sizes[IterKind.kIter_I], sizes[IterKind.kIter_J], sizes[IterKind.kIter_K]
    if k % 8 or n % 8:
        raise _NotThisRule(f"K={k}, N={n} not multiples of 8")
    return _Gemm(block, str(a.dtype), b_last == IterKind.kIter_J, m, n, k,
                 sizes.get(IterKind.kIter_S, 1))


def _innermost_split(stmt, kinds: dict) -> bool:
    """True when a fused K (or J for a K×N B) spans several dims of an operand: the fused
    contiguous run is then shorter than a 16-byte vector may assume."""
    for region in (stmt.reads[0].region, stmt.reads[1].region):
        last = kinds.get(region[-1].min)
        if sum(1 for r in region if kinds.get(r.min) == last) > 1:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# the rule


class GemmSM80(GPUScheduleRule):
    """mma.sync tensor-core GEMM + fused epilogue (see the module docstring)."""

    def __init__(self, config: GemmConfig | None = None,
                 small_m_config: GemmConfig | None = None) -> None:
        self.config = config  # None: LARGE_CONFIG or DEFAULT_CONFIG by the grid it gives
        self.small_m_config = small_m_config or SMALL_M_CONFIG
        for cfg in (config, self.small_m_config):
            if cfg is not None:
                cfg.check()

    def pick_config(self, gemm: _Gemm, device: DeviceProperties | None = None) -> GemmConfig:
        """The tile for ``gemm`` on ``device`` (None: the current target's): the decode tile for
        M ≤ SMALL_M, else the configured one, else LARGE_CONFIG when its grid has a block for
        every SM, else DEFAULT_CONFIG; stages cut to what K fills and shared memory holds."""
        device = device or device_properties()
        if gemm.m <= SMALL_M:
            cfg = self.small_m_config
        elif self.config is not None:
            cfg = self.config
        else:
            big = LARGE_CONFIG
            blocks = gemm.batch * -(-gemm.m // big.block_m) * -(-gemm.n // big.block_n)
            cfg = big if blocks >= device.sms else DEFAULT_CONFIG
        return _fit_smem(_fit_stages(cfg, gemm.k), device.smem_per_block)

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        if target.kind.name != "cuda" or _sm(target) < 80:
            return None
        sch = s_tir.Schedule(func)
        block = _find_gemm(sch)
        if block is None:
            return None  # no GEMM: not this rule's
        try:
            gemm = _analyse(sch, block)
            cfg = self.pick_config(gemm, device_properties(target))
            opts = current_options()
            try:
                self._schedule(sch, gemm, cfg, opts, opts.sm80_epilogue_from_registers)
            except s_tir.ScheduleError:  # e.g. a padded (ragged) C: stage it in shared
                if not opts.sm80_epilogue_from_registers:
                    raise
                sch = s_tir.Schedule(func)
                gemm = _analyse(sch, _find_gemm(sch))
                self._schedule(sch, gemm, cfg, opts, False)
        except _NotThisRule as why:
            return _fallback(func, target, tunable, str(why))
        except s_tir.ScheduleError as err:  # a primitive refusing: fall back, say why (any other
            # exception is a bug: it goes to the fallback point, schedules/fallback.py)
            return _fallback(func, target, tunable, f"schedule failed: {_first_line(err)}")
        func = sch.mod["main"].with_attr(RULE_ATTR, NAME).with_attr(TILE_ATTR, cfg.tag)
        if cfg.one_barrier and cfg.stages >= 3:
            func = func.with_attr(ONE_BARRIER_ATTR, True)
        return s_tir.Schedule(func)

    # -- the schedule -------------------------------------------------------------------------

    def _schedule(self, sch: s_tir.Schedule, gemm: _Gemm, cfg: GemmConfig, opts: Options,
                  direct: bool = False) -> None:
        """Schedule ``gemm`` with tile ``cfg``; ``direct``: the epilogue from registers."""
        block = gemm.block
        # 1. Canonical layout: C[S, I, J] += A[S, I, K] · B[S, J, K] (or B[S, K, J]).
        reindex_a = sch.reindex(block, ("read", 0))
        reindex_b = sch.reindex(block, ("read", 1))
        reindex_c = sch.reindex(block, ("write", 0))
        traits_a, traits_b, traits_c, traits_blk = detect_iter_traits(sch.get(block))
        s_, i_, j_, k_ = IterKind.kIter_S, IterKind.kIter_I, IterKind.kIter_J, IterKind.kIter_K
        fusion = make_iter_fusion_index_map
        sch.transform_layout(reindex_a, ("write", 0), fusion(traits_a, [s_, i_, k_]))
        sch.transform_layout(reindex_b, ("write", 0),
                             fusion(traits_b, [s_, k_, j_] if gemm.b_kn else [s_, j_, k_]))
        sch.transform_layout(reindex_c, ("read", 0), fusion(traits_c, [s_, i_, j_]))
        sch.transform_block_layout(block, fusion(traits_blk, [s_, i_, j_, k_]))
        # 2. Pad M, N, K to the tile (no-op where they divide); padded loads read zeros.
        sch.pad_einsum(block, [1, cfg.block_m, cfg.block_n, cfg.block_k])

        # 3. Tiles: grid × warps × 16×16 fragments; K in block_k steps of 16.
        batch, i, j, k = sch.get_loops(block)
        i, i_mma = sch.split(i, [None, MMA])
        j, j_mma = sch.split(j, [None, MMA])
        k, k_mma = sch.split(k, [None, MMA])
        sch.reorder(i, j, k, i_mma, j_mma, k_mma)
        inner = block
        outer = sch.blockize(i_mma)
        i0, i1, i2 = sch.split(i, [None, cfg.block_m // cfg.warp_m, cfg.warp_m // MMA])
        j0, j1, j2 = sch.split(j, [None, cfg.block_n // cfg.warp_n, cfg.warp_n // MMA])
        k0, k1 = sch.split(k, [None, cfg.block_k // MMA])
        sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
        sch.unroll(i2)  # fragments are registers: every index into them must be a constant
        sch.unroll(j2)
        m_tiles = -(-gemm.m // cfg.block_m)
        group = max(g for g in range(1, cfg.raster + 1) if m_tiles % g == 0)
        if group > 1:  # blocks walk `group` M-tiles down one N-tile column, then the next column
            i0a, i0b = sch.split(i0, [None, group])
            sch.reorder(i0a, j0, i0b)
            bx = sch.fuse(i0a, j0, i0b)
        else:
            bx = sch.fuse(i0, j0)
        sch.bind(bx, "blockIdx.x")
        sch.bind(batch, "blockIdx.y")
        ty = sch.fuse(i1, j1)
        sch.bind(ty, "threadIdx.y")

        # 4. Global → shared: 16-byte cp.async per thread, rows padded by 8 halves.
        def to_shared(index: int) -> s_tir.schedule.SBlockRV:
            copy = sch.cache_read(outer, index, "shared.dyn")
            sch.compute_at(copy, k0)
            fused = sch.fuse(*sch.get_loops(copy)[-2:])
            _, f_ty, f_tx, f_vec = sch.split(fused, [None, cfg.warps, WARP, 8])
            sch.bind(f_ty, "threadIdx.y")
            sch.bind(f_tx, "threadIdx.x")
            sch.vectorize(f_vec)
            sch.unroll(sch.get_loops(copy)[-4])
            sch.storage_align(copy, 0, axis=-2, factor=32, offset=8)
            auto_inline_producers(sch, copy)
            return copy

        to_shared(0)
        to_shared(1)

        # 5. Shared → registers with ldmatrix, one 16×16 fragment per call.
        def by_fragment(block: s_tir.schedule.SBlockRV) -> None:
            """The block's last two loops as unrolled 16×16 fragments (outer) × one fragment."""
            r, c = sch.get_loops(block)[-2:]
            r0, r1 = sch.split(r, [None, MMA])
            c0, c1 = sch.split(c, [None, MMA])
            sch.reorder(r0, c0, r1, c1)
            sch.unroll(r0)
            sch.unroll(c0)

        def to_fragments(index: int) -> s_tir.schedule.SBlockRV:
            frag = sch.cache_read(outer, index, "warp")
            sch.compute_at(frag, k1)
            by_fragment(frag)
            return frag

        a_frag = to_fragments(0)
        b_frag = to_fragments(1)

        intrins = cuda_tensor_intrinsics()

        def ldmatrix_layout(*idx):
            *lead, row, col = idx
            return (*lead, row // MMA, col // MMA,
                    *intrins.shared_16x16_to_ldmatrix_32x8_layout(row % MMA, col % MMA))

        # 6. Accumulators → shared (per warp) → epilogue → global.
        if direct:  # the epilogue on the fragments, stored from registers (no shared memory)
            c_frag = sch.cache_write(outer, 0, "warp")
            auto_inline_consumer_chain(sch, c_frag)
            sch.transform_layout(c_frag, ("read", 0), ldmatrix_layout)
            sch.transform_block_layout(c_frag, lambda b, i, j: ldmatrix_layout(b, i, j))
            sch.reverse_compute_at(c_frag, ty)
            f_i, f_j, f_tx, f_local = sch.get_loops(c_frag)[-4:]
            sch.bind(f_tx, "threadIdx.x")
            # local id = 4·(column half) + 2·(row half) + (column pair): affine pieces
            f_ch, f_rh, f_pair = sch.split(f_local, [2, 2, 2])
            for loop in (f_i, f_j, f_ch, f_rh, f_pair):  # unrolled by nvcc: LowerWarpMemory
                sch.unroll(loop)                          # must see the loop vars (a folded
                sch.annotate(loop, "pragma_unroll_explicit", 0)  # offset ≥ 256 breaks it)
            pair = sch.cache_write(c_frag, 0, "local")  # the two outputs, one vector store
            sch.reverse_compute_at(pair, f_rh, preserve_unit_loops=False)
            sch.vectorize(sch.get_loops(pair)[-1])
        else:
            c_shared = sch.cache_write(outer, 0, "shared.dyn")
            c_frag = sch.cache_write(outer, 0, "warp")
            sch.reverse_compute_at(c_frag, ty)
            sch.reverse_compute_at(c_shared, ty)
            by_fragment(c_frag)

        init = sch.decompose_reduction(outer, k0)
        init_inner = sch.get_child_blocks(init)[0]
        for loop in sch.get_loops(init)[-2:]:
            sch.unroll(loop)

        sch.transform_layout(a_frag, ("write", 0), ldmatrix_layout)
        sch.transform_layout(b_frag, ("write", 0), ldmatrix_layout)
        if not direct:
            sch.transform_layout(c_frag, ("read", 0), ldmatrix_layout)
        dt = gemm.dtype
        sch.tensorize(sch.get_loops(a_frag)[-2], _intrin(intrins.LDMATRIX_f16_A_DYN_INTRIN, dt))
        b_load = intrins.LDMATRIX_f16_B_DYN_INTRIN if gemm.b_kn \
            else intrins.LDMATRIX_f16_B_TRANS_DYN_INTRIN
        sch.tensorize(sch.get_loops(b_frag)[-2], _intrin(b_load, dt))
        mma = intrins.MMA_f16f16f32_INTRIN if gemm.b_kn else intrins.MMA_f16f16f32_TRANS_B_INTRIN
        sch.tensorize(sch.get_loops(inner)[-3], _intrin(mma, dt))
        sch.tensorize(sch.get_loops(init_inner)[-2], intrins.MMA_fill_16x16_f32_INTRIN)
        if not direct:
            c_store_loop = sch.get_loops(c_frag)[-3]
            sch.tensorize(sch.get_loops(c_frag)[-2],
                          intrins.MMA_store_16x16_f32_shared_dyn_INTRIN_SIMPLE)
            if opts.sm80_c_row_pad:  # on the block tensorize made: blockize drops its annotation
                c_store = sch.get_child_blocks(c_store_loop)[0]
                sch.storage_align(c_store, 0, axis=-2, factor=32, offset=opts.sm80_c_row_pad)

        # 7. Software pipelines. k1 = [A frag, B frag, mma]: fragments one k-step ahead. It is
        # expanded first, so k0 = [A copy, B copy, k1 prologue, k1 body, k1 epilogue]: copies run
        # `stages - 1` tiles ahead (cp.async), and the next tile's first fragments are loaded
        # (prologue, stage - 1 behind the copies) right after the current tile's last mma.
        sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])
        sch.annotate(k1, "software_pipeline_order", [0, 1, 2])
        # One K tile (K ≤ block_k): no copy pipeline. TVM's injector commits that tile's cp.async
        # group only after the first fragment loads, whose wait_group then waits for nothing:
        # ldmatrix raced the copies (H200: 0.5 relative error, batched QKᵀ with K = 64).
        if -(-gemm.k // cfg.block_k) > 1:
            last = cfg.stages - 1
            sch.annotate(k0, "software_pipeline_stage", [0, 0, max(last - 1, 0), last, last])
            sch.annotate(k0, "software_pipeline_order", [0, 1, 3, 2, 4])
            sch.annotate(k0, "software_pipeline_async_stages", [0])

        # 8. Epilogue: every consumer of C inlined into the shared → global copy, which then
        # runs as [rows, 32 lanes, V] with 16-byte vector loads of C and stores of the output.
        if not direct:
            auto_inline_consumer_chain(sch, c_shared)
            self._epilogue(sch, c_shared, opts.sm80_epilogue_lane_elems)

    @staticmethod
    def _epilogue(sch: s_tir.Schedule, store: s_tir.schedule.SBlockRV,
                  lane_elems: int | None) -> None:
        """The warp's ``rows × cols`` output tile: each lane owns ``V``-wide row pieces
        (``lane_elems``, else 16 bytes of the output dtype), lanes side by side along a row, then
        down the rows."""
        out = sch.get(store).writes[0].source
        vec = lane_elems or VECTOR_BYTES // max(1, tvm.DataType(str(out.dtype)).bits // 8)
        r, c = sch.get_loops(store)[-2:]
        rows, cols = const_int(sch.get(r).extent), const_int(sch.get(c).extent)
        while vec > 1 and cols % vec:
            vec //= 2
        lanes_c = min(WARP, cols // vec)
        lanes_r = WARP // lanes_c
        if rows % lanes_r or (cols // vec) % lanes_c:
            raise _NotThisRule(f"warp tile {rows}x{cols} does not fit {WARP} lanes")
        c0, c1, v = sch.split(c, [None, lanes_c, vec])
        r0, r1 = sch.split(r, [None, lanes_r])
        sch.reorder(r0, c0, r1, c1, v)
        tx = sch.fuse(r1, c1)
        sch.bind(tx, "threadIdx.x")
        sch.unroll(v)
        c_index = next(i for i, reg in enumerate(sch.get(store).reads)
                       if str(reg.source.scope()) == "shared.dyn")
        load = sch.cache_read(store, c_index, "local")
        sch.compute_at(load, tx, preserve_unit_loops=False)
        _vector(sch, sch.get_loops(load)[-1], 4)
        result = sch.cache_write(store, 0, "local")
        sch.reverse_compute_at(result, tx, preserve_unit_loops=False)
        _vector(sch, sch.get_loops(result)[-1], vec)


def _vector(sch: s_tir.Schedule, loop, lanes: int) -> None:
    """Vectorise ``loop`` in pieces of ``lanes`` (16 bytes of the widest dtype it moves)."""
    extent = const_int(sch.get(loop).extent)
    if extent is not None and extent > lanes and extent % lanes == 0:
        outer, loop = sch.split(loop, [None, lanes])
        sch.unroll(outer)
    sch.vectorize(loop)


def _sm(target: Target) -> int:
    arch = str(target.attrs.get("arch", ""))
    digits = "".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit())
    return int(digits) if digits else 0


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    text = lines[-1] if lines else type(err).__name__
    return text[:200]


class Matmul(dl.gpu.Matmul):
    """dlight's Matmul, given an arch it can read: its ``check_sm_version`` parses ``sm_90a`` as −1
    (no tensor cores: it gave sm_90a GEMMs CUDA-core kernels); with ``sm_90`` it schedules the same
    wmma code, which the real target compiles."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        arch = str(target.attrs.get("arch", "")) if target.kind.name == "cuda" else ""
        if arch.startswith("sm_") and arch[-1].isalpha() and arch[3:-1].isdigit():
            target = Target({**dict(target.export()), "arch": arch[:-1]})
        return super().apply(func, target, tunable)


def _fallback(func: tirx.PrimFunc, target: Target, tunable: bool, reason: str):
    """dlight's GEMV (guarded), then Matmul, on ``func`` marked with why this rule did not take it
    (after the reason an earlier rule, the sm90 GEMM's, recorded)."""
    earlier = str(func.attrs[FALLBACK_ATTR]) if func.attrs is not None and FALLBACK_ATTR in func.attrs \
        else None
    marked = func.with_attr(FALLBACK_ATTR, f"{earlier}; {reason}" if earlier else reason)
    for rule in (GuardedGEMV(), Matmul()):
        sch = rule.apply(marked, target, tunable)
        if sch is not None:
            return sch
    return None
