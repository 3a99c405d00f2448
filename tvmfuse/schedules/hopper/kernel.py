"""TIRx text of a warp-specialised Hopper GEMM: TMA → mbarrier ring → wgmma, epilogue in registers.

``C[m, n] = epilogue(Σ_k A[m, k] · B[n, k])`` (``layout="nt"``, B is (N, K) K-major) or
``Σ_k A[m, k] · B[k, n]`` (``layout="nn"``, B is (K, N), read MN-major by wgmma).
A is (M, K) row-major; fp16 / bf16 inputs, fp32 accumulation.

One CTA computes a ``BM × BN`` tile with ``1 + BM/64`` warpgroups:

* warpgroup 0 (producer): one thread issues the TMA loads of stage ``s`` (A box 64×BM, B boxes
  64×BN or 64×64 chunks, 128-byte swizzle) after the consumers freed it (``empty[s]``), and
  announces the bytes on ``full[s]`` (``mbarrier.arrive.expect_tx``);
* warpgroups 1.. (consumers): each owns 64 rows; per K tile it waits ``full[s]``, issues
  ``BK/16`` ``wgmma.mma_async.m64n{BN}k16`` on shared-memory descriptors, keeps one wgmma group
  in flight and releases the previous stage (``empty``) once that group retired.

Options (:class:`GemmConfig`): ``cluster_m=2`` pairs CTAs (m, n) and (m+1, n) in a cluster; each
producer loads its own A box and half of the B tile, multicast into the same offset of both CTAs,
and a consumer frees a stage in both (``mbarrier.arrive.shared::cluster`` on the peer's ``empty``
via ``mapa``), so a stage costs each CTA 32 instead of 48 KiB of L2 reads. ``warp_release``: one
lane a warp frees a stage. ``pingpong``: the consumers take alternate tiles of ``bm`` rows (one or
two 64-row accumulator chains each), ordered by a ``turn`` barrier pair so that their main loops
alternate (measured slower than the cooperative default; kept for experiments).

``setmaxnreg`` moves registers from the producer to the consumers. The epilogue runs on the
accumulator fragment (thread t of a consumer owns rows ``16·(t/32) + (t%32)/4 (+8)`` and columns
``8·j + 2·(t%4) (+1)``); here the kernel stores ``cast(acc)`` and :mod:`.epilogue` substitutes the
fused expression. A *pair* epilogue (``pair_value``) combines the thread's two accumulators of
columns (2c, 2c + 1) into ``C[row, c]`` of an N/2-wide output. Rows ≥ M and columns ≥ N are
masked on store; TMA fills out-of-range loads with
zeros, so any M, N and any K that is a multiple of 8 (16-byte TMA strides) work.

*Row statistics* (``row_stats``, a :class:`RowStats`): the consumers also compute the LayerNorm /
RMSNorm statistics of their A rows from the A stages the main loop already has in shared memory,
so no separate statistics kernel runs. The 128-byte swizzle permutes 16-byte chunks within a
128-byte row only, so a row of the stage sums to the same value in any order: thread t of a
consumer reads four of the eight 16-byte chunks of row ``t / 2`` right after issuing its
wgmmas (the stage is released later as before, so no new synchronisation) and accumulates, in fp32,

    s1 = Σ_k (x[r, k] − c),   s2 = Σ_k (x[r, k] − c)²      (LayerNorm; c = one element of the row)
    s2 = Σ_k x[r, k]²                                       (RMSNorm)

The shift c (an element of the row's first K tile) keeps E[(x−c)²] − E[x−c]² free of the
cancellation that E[x²] − mean² suffers when |mean| ≫ std. TMA's zero fill of columns ≥ K adds
``P = 64·⌈K/64⌉ − K`` terms of −c and c², removed after the loop. Then (true K)

    mean = c + s1/K,   rstd = rsqrt(max(s2/K − (s1/K)², 0) + eps)      (RMSNorm: rsqrt(s2/K + eps))

Lanes t, t^1 combine their halves with one ``shfl.xor``; the rows of warp w's fragment (16w + t%32/4
and + 8) are exactly the rows its lanes summed, so four indexed shuffles hand each thread the
statistics of its two fragment rows (no shared memory, no barrier). The epilogue reads them as
:data:`ROW_MEAN` / :data:`ROW_RSTD` (text valid where ``h`` is the fragment's row half).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

WG = 128  # threads per warpgroup
BK = 64  # K per stage: one 128-byte swizzle row of fp16 / bf16
SW128 = 3  # CUtensorMapSwizzle / descriptor code of the 128-byte swizzle
# epilogue text of the statistics of row ``row0 + h·8`` when the kernel computes them (row_stats)
ROW_MEAN = "rstat[h * 2]"
ROW_RSTD = "rstat[h * 2 + 1]"


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipeline depth of one kernel."""

    bm: int = 128  # rows per CTA: 64 per consumer warpgroup
    bn: int = 256  # columns per CTA (wgmma N)
    stages: int = 4
    group_m: int = 8  # tile rasterisation: GROUP_M row tiles share their B tiles in L2
    producer_regs: int = 40
    consumer_regs: int = 232
    persistent: bool = True  # one CTA per SM loops over tiles: next tile's loads overlap the epilogue
    num_sms: int = 132  # H200
    vector_store: bool = True  # column pairs stored as one 2-element vector
    pair_shuffle: bool = True  # pair epilogue: lanes t, t^1 swap one value, store 2-element vectors
    ctas_per_sm: int = 1  # > 1: co-resident CTAs (launch bounds), one's epilogue overlaps another's MMAs
    cluster_m: int = 1  # 2: CTA pairs (tiles m, m+1) share the B tile: each loads half, multicast to both
    warp_release: bool = False  # one lane per consumer warp (not every thread) frees a stage
    # two consumer warpgroups on alternate tiles of bm = 64 rows: one's epilogue runs while the
    # other's wgmmas keep the tensor cores busy (the producer fills the ring in tile order)
    pingpong: bool = False
    wg_rows: int = 64  # cooperative: rows per consumer warpgroup (128: two 64-row chains each)

    @property
    def consumers(self) -> int:
        return 2 if self.pingpong else self.bm // self.wg_rows

    @property
    def chains(self) -> int:
        """Independent 64-row accumulator chains per consumer (ping-pong: the whole tile)."""
        return self.bm // 64 if self.pingpong else self.wg_rows // 64

    @property
    def release_count(self) -> int:
        """Arrivals that free one stage: every consumer thread (or warp) of every CTA reading it."""
        readers = 1 if self.pingpong else self.consumers  # warpgroups reading one stage
        per_cta = readers * (WG // 32 if self.warp_release else WG)
        return per_cta * self.cluster_m

    @property
    def threads(self) -> int:
        return WG * (1 + self.consumers)

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        return self.stages * (self.bm + self.bn) * BK * elem_bytes


@dataclass(frozen=True)
class GemmProblem:
    """What the kernel computes: shapes, dtypes, layout of B."""

    m: int
    n: int
    k: int
    in_dtype: str  # float16 | bfloat16
    out_dtype: str
    layout: str = "nt"  # "nt": B (N, K); "nn": B (K, N)


@dataclass(frozen=True)
class RowStats:
    """Per-row statistics of A (over its K columns) that the kernel computes in its main loop.

    ``centered``: LayerNorm (mean and rstd); otherwise RMSNorm (rstd only). ``eps`` as in the norm.
    """

    centered: bool
    eps: float


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def check(problem: GemmProblem, cfg: GemmConfig) -> str | None:
    """Why this kernel cannot compute ``problem`` with ``cfg`` (None: it can)."""
    if problem.in_dtype not in ("float16", "bfloat16"):
        return f"input dtype {problem.in_dtype} (fp16/bf16 only)"
    if problem.k % 8:
        return f"K={problem.k} is not a multiple of 8 (TMA needs 16-byte row strides)"
    if problem.layout == "nn" and problem.n % 8:
        return f"N={problem.n} is not a multiple of 8 (TMA needs 16-byte row strides of B)"
    if problem.n % 2:
        return f"N={problem.n} is odd (the epilogue stores column pairs)"
    if cfg.bm % 64 or cfg.bm > 256 or cfg.bn % 64 or cfg.bn > 256:
        return f"tile {cfg.bm}x{cfg.bn} unsupported"
    if cfg.pingpong and cfg.bm * cfg.bn > 128 * 128:
        return f"ping-pong tile {cfg.bm}x{cfg.bn}: one warpgroup holds at most 128x128 accumulators"
    if cfg.wg_rows not in (64, 128) or cfg.bm % cfg.wg_rows or (cfg.wg_rows > 64 and cfg.bn > 128):
        return f"{cfg.wg_rows} rows a warpgroup with a {cfg.bm}x{cfg.bn} tile unsupported"
    if cfg.cluster_m not in (1, 2) or (cfg.cluster_m == 2 and cfg.ctas_per_sm != 1):
        return f"cluster of {cfg.cluster_m} CTAs unsupported (1, or 2 with one CTA per SM)"
    if cfg.smem_bytes() * cfg.ctas_per_sm > 227 * 1024:
        return (f"{cfg.smem_bytes()} bytes of shared memory per CTA x {cfg.ctas_per_sm} CTAs "
                "exceed 227 KiB")
    if problem.m >= 2**31 or problem.n >= 2**31 or problem.k >= 2**31:
        return "dimension beyond int32"
    return None


def kernel_text(problem: GemmProblem, cfg: GemmConfig, func_name: str, params: list[str],
                a_param: int, b_param: int, c_param: int,
                param_decls: list[tuple[str, tuple[int, ...], str]],
                store_value: Callable[[str, str, str], str] | None = None,
                pair_value: Callable[[str, str, str, str], str] | None = None,
                row_stats: RowStats | None = None) -> str:
    """TVMScript (tirx) source of the kernel.

    ``params``/``param_decls`` keep the fused PrimFunc's signature (name, shape, dtype per
    parameter) so the kernel replaces it in place; A, B, C are the parameters at the given
    positions. ``store_value(acc, row, col)`` gives the TVMScript text of the value stored at
    ``C[row, col]`` from the accumulator element ``acc`` (default: the cast to C's dtype).
    ``pair_value(acc_even, acc_odd, row, col)`` instead makes C (M, N/2) with ``C[row, col]``
    computed from the accumulators of GEMM columns ``2·col`` and ``2·col + 1``.
    ``row_stats``: the consumers also compute A's row statistics, which the epilogue text reads as
    :data:`ROW_MEAN` / :data:`ROW_RSTD`.
    """
    p, c = problem, cfg
    ab = {"float16": "f16", "bfloat16": "bf16"}[p.in_dtype]
    trans_b = 1 if p.layout == "nn" else 0
    kt_total = _cdiv(p.k, BK)
    tiles_m, tiles_n = _cdiv(p.m, c.bm), _cdiv(p.n, c.bn)
    a_stage = c.bm * BK * 2
    b_stage = c.bn * BK * 2
    stage_bytes = a_stage + b_stage
    acc_n = c.bn // 2  # fp32 accumulators per consumer thread and 64-row chain (64 x BN / 128)
    sub = c.chains
    if row_stats and sub > 1:
        raise ValueError("in-loop row statistics need one 64-row chain per consumer warpgroup")
    # B smem layout: nt -> BN rows of 128 B (K-major); nn -> BN/64 chunks of [64 k][64 n].
    cl = c.cluster_m
    # this consumer's first 64-row block of the A stage / tile
    wg_row = "0" if c.pingpong else f"(wg - 1) * {c.wg_rows // 64}" if c.wg_rows > 64 else "(wg - 1)"
    if p.layout == "nt":
        b_box = (BK, c.bn // cl)
        b_boxes = [("kt * 64", "n0", 0)] if cl == 1 else [
            ("kt * 64", f"n0 + rank * {c.bn // 2}", f"rank * {c.bn // 2 * BK * 2}")]
        b_lbo, b_sbo, b_kstep = 1, 64, 32  # 16-byte units; K step of 16 elements = 32 bytes
        b_dims = (p.k, p.n)
    else:
        b_box = (64, BK)
        half = c.bn // 64 // cl  # 64-column chunks this CTA loads
        b_boxes = [(f"n0 + {j * 64}" if cl == 1 else f"n0 + (rank * {half} + {j}) * 64", "kt * 64",
                    j * 64 * BK * 2 if cl == 1 else f"(rank * {half} + {j}) * {64 * BK * 2}")
                   for j in range(half)]
        b_lbo, b_sbo, b_kstep = (64 * BK * 2) // 16, 64, 16 * 128  # 16 K rows of 128 B
        b_dims = (p.n, p.k)
    e = p.in_dtype
    value = store_value or (lambda acc, row, col: f'T.Cast("{p.out_dtype}", {acc})')
    lines: list[str] = []
    w = lines.append
    sig = ", ".join(f"{n}_h: T.handle" for n in params)
    w("@T.prim_func")
    w(f"def {func_name}({sig}):")
    w('    T.func_attr({"tirx.noalias": True})')
    for name, shape, dtype in param_decls:
        w(f"    {name} = T.match_buffer({name}_h, {tuple(shape)}, \"{dtype}\", align=16)")
    a_name, b_name, c_name = params[a_param], params[b_param], params[c_param]
    c_cols = p.n // 2 if pair_value else p.n
    w(f"    C2 = T.decl_buffer(({p.m}, {c_cols}), \"{p.out_dtype}\", data={c_name}.data)")
    # host: tensor maps (dims innermost first, byte strides, box, element strides, interleave,
    # swizzle, L2 promotion 256 B, OOB fill zeros)
    w('    A_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)')
    w(f'    T.call_packed("runtime.cuTensorMapEncodeTiled", A_map, "{e}", 2, {a_name}.data, '
      f"{p.k}, {p.m}, {p.k * 2}, {BK}, {c.bm}, 1, 1, 0, {SW128}, 2, 0)")
    w('    B_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)')
    w(f'    T.call_packed("runtime.cuTensorMapEncodeTiled", B_map, "{e}", 2, {b_name}.data, '
      f"{b_dims[0]}, {b_dims[1]}, {b_dims[0] * 2}, {b_box[0]}, {b_box[1]}, 1, 1, 0, {SW128}, 2, 0)")
    w("    T.device_entry()")
    device_start = len(lines)
    # a cluster of cl CTAs owns cl row tiles of one column tile: "tiles" counts those units
    units_m = _cdiv(tiles_m, cl)
    tiles = units_m * tiles_n
    grid = min(tiles, c.num_sms * c.ctas_per_sm // cl) if c.persistent else tiles
    rounds = _cdiv(tiles, grid)  # tiles per CTA (the last round may be partial)
    w(f"    bid = T.cta_id([{grid * cl}])")
    if cl > 1:
        w(f"    rank = T.cta_id_in_cluster([{cl}])")
    w(f"    tx = T.thread_id([{c.threads}])")
    w(f'    smem = T.alloc_buffer(({c.stages * stage_bytes // 2},), "{e}", scope="shared.dyn", '
      "align=1024)")
    w(f'    full = T.alloc_shared([{c.stages}], "uint64")')
    w(f'    empty = T.alloc_shared([{c.stages}], "uint64")')
    if c.pingpong:  # turn[i]: warpgroup i + 1 may start its next main loop
        w('    turn = T.alloc_shared([2], "uint64")')
    group = max(1, min(c.group_m // cl, units_m))
    in_group = group * tiles_n
    unit = "bid" if cl == 1 else f"bid // {cl}"

    def tile_loop(sp: str, mine: str = "") -> None:
        """Open the loop over this CTA's tiles; m0, n0 = the tile's origin (grouped raster).
        ``mine``: a condition on ``ti`` selecting this warpgroup's tiles (ping-pong)."""
        w(f"{sp}for ti in T.serial({rounds}):")
        w(f"{sp}    tile = {unit} + ti * {grid}")
        w(f"{sp}    if tile < {tiles}{mine}:")
        w(f"{sp}        first_m = (tile // {in_group}) * {group}")
        w(f"{sp}        gsize = T.min({units_m} - first_m, {group})")
        mt = f"(first_m + (tile % {in_group}) % gsize)"
        w(f"{sp}        m0 = {mt if cl == 1 else f'({mt} * {cl} + rank)'} * {c.bm}")
        w(f"{sp}        n0 = ((tile % {in_group}) // gsize) * {c.bn}")

    w("    wg = tx // 128")
    w("    if tx == 0:")
    w(f"        for s in T.unroll({c.stages}):")
    init = "            T.ptx.mbarrier.init.shared.b64(T.cuda.cvta_generic_to_shared("
    w(init + "full.ptr_to([s])), T.uint32(1))")
    w(init + f"empty.ptr_to([s])), T.uint32({c.release_count}))")
    if c.pingpong:
        w("        for i in T.unroll(2):")
        w(init + "turn.ptr_to([i])), T.uint32(1))")
    w("    T.ptx.fence.mbarrier_init.release.cluster()")
    # a cluster: the peer's TMA and stage releases reach this CTA's barriers once both initialised
    w("    T.cuda.cluster_sync()" if cl > 1 else "    T.cuda.cta_sync()")
    w("    if wg == 0:")
    w(f'        T.ptx["setmaxnreg.dec.sync.aligned.u32"]({c.producer_regs})')
    w("        if tx == 0:")
    tile_loop("            ")
    w(f"                    for kt in T.serial({kt_total}):")
    w(f"                        g = ti * {kt_total} + kt  # k-tiles issued before this one")
    w(f"                        s = g % {c.stages}")
    w(f"                        if g >= {c.stages}:")
    w(f"                            T.cuda.mbarrier_wait(empty.ptr_to([s]), (g // {c.stages} + 1) % 2)")
    w("                        T.ptx.mbarrier.arrive.expect_tx.shared.b64("
      f"T.cuda.cvta_generic_to_shared(full.ptr_to([s])), T.uint32({stage_bytes}))")
    tma = 'T.ptx["cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"]'
    tma_mc = tma[:-2] + '.multicast::cluster"]'
    w(f"                        {tma}(T.cuda.cvta_generic_to_shared(smem.ptr_to("
      f"[s * {stage_bytes // 2}])), T.address_of(A_map), kt * 64, m0, "
      "T.cuda.cvta_generic_to_shared(full.ptr_to([s])))")
    for c0, c1, off in b_boxes:
        dst = f"s * {stage_bytes // 2} + {a_stage // 2} + ({off}) // 2"
        args = (f"T.cuda.cvta_generic_to_shared(smem.ptr_to([{dst}])), T.address_of(B_map), {c0}, {c1}, "
                "T.cuda.cvta_generic_to_shared(full.ptr_to([s]))")
        if cl == 1:
            w(f"                        {tma}({args})")
        else:  # the same smem offset and barrier in every CTA of the cluster (mask: all)
            w(f"                        {tma_mc}({args}, T.uint16({(1 << cl) - 1}))")
    w("    else:")
    w(f'        T.ptx["setmaxnreg.inc.sync.aligned.u32"]({c.consumer_regs})')
    w(f'        acc = T.alloc_buffer(({acc_n * sub},), "float32", scope="local")')
    w('        desc_a = T.alloc_buffer((1,), "uint64", scope="local")')
    w('        desc_b = T.alloc_buffer((1,), "uint64", scope="local")')
    w("        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a[0]), "
      f"smem.ptr_to([{wg_row} * {64 * 64}]), 1, 64, {SW128})")
    w("        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b[0]), "
      f"smem.ptr_to([{a_stage // 2}]), {b_lbo}, {b_sbo}, {SW128})")
    accs = [", ".join(f"acc[{u * acc_n + i}]" for i in range(acc_n)) for u in range(sub)]
    mma = f'T.ptx["wgmma.mma_async.sync.aligned.m64n{c.bn}k16.f32.{ab}.{ab}"]'
    if (c.vector_store and not pair_value) or (pair_value and c.pair_shuffle):
        pair_align = max(4, 2 * (8 if p.out_dtype.endswith("64") else 4 if p.out_dtype.endswith("32")
                                 else 2))
        w(f'        pair = T.alloc_buffer((2,), "{p.out_dtype}", scope="local", align={pair_align})')
    if row_stats:
        w(f'        xv = T.alloc_buffer((8,), "{e}", scope="local", align=16)')
        w('        rsum = T.alloc_buffer((3,), "float32", scope="local")')  # s1, s2, shift c
        w('        rstat = T.alloc_buffer((4,), "float32", scope="local")')  # ROW_MEAN, ROW_RSTD
    if cl > 1:  # the peer CTA's empty barriers in the cluster's shared window
        w('        peer_empty = T.alloc_buffer((1,), "uint32", scope="local")')
        w("        T.ptx.mapa.shared__cluster.u32(peer_empty[0], T.cuda.cvta_generic_to_shared("
          "empty.ptr_to([0])), T.uint32(rank ^ 1))")
    tile_loop("        ", " and ti % 2 == wg - 1" if c.pingpong else "")
    if c.pingpong:
        # Main loops alternate: warpgroup w starts tile ti once the other one has passed every
        # full-barrier wait of tile ti - 1. Without this order a warpgroup waiting for a stage's
        # phase two ahead of the barrier's would pass on the parity of the older phase.
        w("                if ti > 0:")
        w("                    T.cuda.mbarrier_wait(turn.ptr_to([wg - 1]), ((ti - 1) // 2) % 2)")
    w(f"                for i in T.unroll({acc_n * sub}):")
    w("                    acc[i] = T.float32(0)")
    if row_stats:
        for i in range(3):
            w(f"                rsum[{i}] = T.float32(0)")
    w(f"                for kt in T.serial({kt_total}):")
    w(f"                    g = ti * {kt_total} + kt")
    w(f"                    s = g % {c.stages}")
    w(f"                    T.cuda.mbarrier_wait(full.ptr_to([s]), (g // {c.stages}) % 2)")
    w("                    T.ptx.wgmma.fence.sync.aligned()")
    w(f"                    for kk in T.unroll({BK // 16}):")
    for u in range(sub):  # chain u: rows 64u.. of this consumer's tile (8 KiB into the A stage)
        w(f"                        {mma}({accs[u]}, "
          f"desc_a[0] + T.uint64((s * {stage_bytes} + kk * 32{f' + {u * 64 * BK * 2}' if u else ''})"
          " // 16), "
          f"desc_b[0] + T.uint64((s * {stage_bytes} + kk * {b_kstep}) // 16), "
          f"True, 1, 1, 0, {trans_b})")
    w("                    T.ptx.wgmma.commit_group.sync.aligned()")
    if row_stats:  # while the wgmmas run: this thread's half row of the stage
        _row_stats_accumulate(w, row_stats, stage_bytes, e, wg_row)
    w("                    T.ptx.wgmma.wait_group.sync.aligned(1)")
    _release(w, c, "                    ", f"(g + {c.stages - 1}) % {c.stages}", "kt > 0")
    if c.pingpong:  # one thread past the last full wait of this tile: the other's turn
        w("                if tx % 128 == 0:")
        w("                    T.ptx.mbarrier.arrive.shared.b64(T.cuda.cvta_generic_to_shared("
          "turn.ptr_to([2 - wg])))")
    w("                T.ptx.wgmma.wait_group.sync.aligned(0)")
    _release(w, c, "                ", f"(ti * {kt_total} + {kt_total - 1}) % {c.stages}", None)
    # epilogue: fragment -> global, rows/cols masked (N even: a pair is in or out as a whole)
    w("                t = tx % 128")
    epi_start = len(lines)
    w(f"                row0 = m0 + {wg_row} * 64 + (t // 32) * 16 + (t % 32) // 4")
    if row_stats:
        _row_stats_finish(w, row_stats, p.k, kt_total * BK - p.k)
    # A tile inside (M, N) stores without per-element guards: straight-line code whose loads
    # (bias, residual) and arithmetic the compiler can schedule across elements.
    full = [f"m0 + {c.bm} <= {p.m}"] * (p.m % c.bm != 0) + [f"n0 + {c.bn} <= {p.n}"] * (p.n % c.bn != 0)

    def store(guarded: bool, out: Callable[[str], None]) -> None:
        if pair_value and c.pair_shuffle:
            _pair_shuffle_store(out, p, c, pair_value, guarded)
        else:
            _store(out, p, c, value, pair_value, guarded)

    if not UNGUARDED_FULL_TILES or not full:  # every tile guarded, or none needs it
        store(not UNGUARDED_FULL_TILES, w)
    else:
        def nested(ln: str) -> None:
            w("    " + ln)

        w(f"                if {' and '.join(full)}:")
        store(False, nested)
        w("                else:")
        store(True, nested)
    return _finish(_chains(lines, epi_start, sub, acc_n), device_start, c)


UNGUARDED_FULL_TILES = True  # A/B switch for measurements: False keeps the guards on every tile


def _store(w: Callable[[str], None], p: GemmProblem, c: GemmConfig,
           value: Callable[[str, str, str], str], pair_value, guarded: bool) -> None:
    """Fragment → C: a column pair per thread; ``guarded``: row and column masked (N even: a pair
    is in or out as a whole)."""
    w(f"                for j in T.unroll({c.bn // 8}):")
    w("                    col = n0 + j * 8 + (t % 4) * 2")
    w("                    for h in T.unroll(2):")
    sp = "                        "
    if guarded:
        w(f"{sp}if row0 + h * 8 < {p.m} and col < {p.n}:")
        sp += "    "
    if pair_value:
        w(f"{sp}C2[row0 + h * 8, col // 2] = " + pair_value(
            "acc[j * 4 + h * 2]", "acc[j * 4 + h * 2 + 1]", "(row0 + h * 8)", "(col // 2)"))
    elif c.vector_store:
        for q in range(2):
            w(f"{sp}pair[{q}] = "
              + value(f"acc[j * 4 + h * 2 + {q}]", "(row0 + h * 8)", f"(col + {q})"))
        w(f"{sp}C2[row0 + h * 8, T.Ramp(col, 1, 2)] = pair[T.Ramp(0, 1, 2)]")
    else:
        for q in range(2):
            w(f"{sp}C2[row0 + h * 8, col + {q}] = "
              + value(f"acc[j * 4 + h * 2 + {q}]", "(row0 + h * 8)", f"(col + {q})"))


def _chains(lines: list[str], start: int, sub: int, acc_n: int) -> list[str]:
    """With ``sub`` accumulator chains the epilogue ``lines[start:]`` runs once per chain ``u``:
    rows 64u further down, accumulators ``u·acc_n`` further on."""
    if sub == 1:
        return lines
    body = ["    " + ln.replace("acc[", f"acc[u * {acc_n} + ").replace(
        "row0 = m0 + ", "row0 = m0 + u * 64 + ") for ln in lines[start:]]
    return lines[:start] + [f"                for u in T.unroll({sub}):"] + body


def _release(w: Callable[[str], None], c: GemmConfig, sp: str, stage: str, cond: str | None) -> None:
    """Free ``stage`` for the producers: this CTA's ``empty`` barrier and, in a cluster, the peer's
    (its producer multicasts into this CTA's copy of the stage); by every thread or one lane a warp."""
    conds = ([cond] if cond else []) + (["tx % 32 == 0"] if c.warp_release else [])
    if conds:
        w(f"{sp}if {' and '.join(conds)}:")
        sp += "    "
    w(f"{sp}T.ptx.mbarrier.arrive.shared.b64(T.cuda.cvta_generic_to_shared(empty.ptr_to([{stage}])))")
    if c.cluster_m > 1:
        w(f"{sp}T.ptx.mbarrier.arrive.shared__cluster.b64(peer_empty[0] + T.uint32(({stage}) * 8))")


def _row_stats_accumulate(w: Callable[[str], None], rs: RowStats, stage_bytes: int,
                          e: str, wg_row: str) -> None:
    """Thread t adds half ``t % 2`` of row ``t / 2`` of its warpgroup's 64 A rows of stage s."""
    sp = "                    "
    row = f"s * {stage_bytes // 2} + {wg_row} * {64 * BK} + ((tx % 128) // 2) * {BK}"
    if rs.centered:  # shift: the first stored element of the row in the first K tile
        w(f"{sp}if kt == 0:")
        w(f'{sp}    rsum[2] = T.Cast("float32", smem[{row}])')
    # physical 16-byte chunk ((t % 2)·4 + q) ^ (row % 8): the 8 lanes of one shared-memory phase
    # read 8 different chunks (all 32 banks); the pair t, t^1 still covers the row's 8 chunks
    w(f"{sp}for q in T.unroll(4):")
    w(f"{sp}    xv[T.Ramp(0, 1, 8)] = smem[T.Ramp({row} + T.bitwise_xor((tx % 2) * 4 + q, "
      f"((tx % 128) // 2) % 8) * 8, 1, 8)]")
    w(f"{sp}    for v in T.unroll(8):")
    if rs.centered:
        w(f'{sp}        rsum[0] = rsum[0] + (T.Cast("float32", xv[v]) - rsum[2])')
        w(f'{sp}        rsum[1] = rsum[1] + (T.Cast("float32", xv[v]) - rsum[2]) * '
          f'(T.Cast("float32", xv[v]) - rsum[2])')
    else:
        w(f'{sp}        rsum[1] = rsum[1] + T.Cast("float32", xv[v]) * T.Cast("float32", xv[v])')


def _row_stats_finish(w: Callable[[str], None], rs: RowStats, k: int, pad: int) -> None:
    """Combine the two half rows, form (mean, rstd) per row, and give each thread the statistics
    of its fragment rows ``16·(t/32) + (t%32)/4`` (+ 8), summed by lanes ``2·((t%32)/4)`` (+ 16)."""
    sp = "                "
    full = "T.uint32(4294967295)"
    for i in (0, 1) if rs.centered else (1,):
        w(f"{sp}rsum[{i}] = rsum[{i}] + T.cuda.__shfl_xor_sync({full}, rsum[{i}], 1, 32)")
    if rs.centered:
        if pad:  # TMA's zero columns: P terms (0 − c) and (0 − c)² came in
            w(f"{sp}rsum[0] = rsum[0] + T.float32({float(pad)}) * rsum[2]")
            w(f"{sp}rsum[1] = rsum[1] - T.float32({float(pad)}) * rsum[2] * rsum[2]")
        w(f"{sp}rsum[0] = rsum[0] / T.float32({float(k)})")  # mean − c
        w(f"{sp}rsum[1] = T.rsqrt(T.max(rsum[1] / T.float32({float(k)}) - rsum[0] * rsum[0], "
          f"T.float32(0)) + T.float32({rs.eps!r}))")
        w(f"{sp}rsum[0] = rsum[0] + rsum[2]")
    else:
        w(f"{sp}rsum[1] = T.rsqrt(rsum[1] / T.float32({float(k)}) + T.float32({rs.eps!r}))")
    w(f"{sp}for h in T.unroll(2):")
    src = "((tx % 32) // 4) * 2 + h * 16"
    if rs.centered:
        w(f"{sp}    rstat[h * 2] = T.cuda.__shfl_sync({full}, rsum[0], {src}, 32)")
    w(f"{sp}    rstat[h * 2 + 1] = T.cuda.__shfl_sync({full}, rsum[1], {src}, 32)")


def _finish(lines: list[str], device_start: int, c: GemmConfig) -> str:
    """The kernel text; with ``ctas_per_sm > 1`` the device body sits in a launch-bounds attr
    (``__launch_bounds__(threads, ctas_per_sm)``: ptxas keeps the registers for co-residence)."""
    if c.cluster_m > 1:  # no CTA exits while its peer may still arrive on its barriers
        lines = [*lines, "    T.cuda.cluster_sync()"]
    if c.ctas_per_sm > 1:
        body = ["    " + ln for ln in lines[device_start:]]
        lines = lines[:device_start] + [
            f'    with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", {c.ctas_per_sm}):'] + body
    return "\n".join(lines) + "\n"


def _pair_shuffle_store(w: Callable[[str], None], p: GemmProblem, c: GemmConfig,
                        pair_value: Callable[[str, str, str, str], str], guarded: bool) -> None:
    """Pair epilogue stored as 2-element vectors (16 contiguous bytes per row and quad).

    For fragment columns ``j = 2q`` and ``2q + 1`` lane ``r = t % 4`` of a quad holds outputs
    ``v0`` at column ``8q + r`` and ``v1`` at ``8q + 4 + r`` (relative to ``n0 / 2``). One
    ``shfl.xor 1`` (odd lanes send ``v0``, even lanes ``v1``) gives even lanes the pair
    ``(v0, partner's v0)`` at ``8q + r`` and odd lanes ``(partner's v1, v1)`` at ``8q + r + 3``.
    Every lane shuffles (``guarded``: rows and columns are masked at the store only).
    """
    n_out = p.n // 2
    w("                r = t % 4")
    w(f"                for q in T.unroll({c.bn // 16}):")
    w("                    for h in T.unroll(2):")
    w("                        row = row0 + h * 8")
    w("                        c0 = n0 // 2 + q * 8 + r")
    w("                        v0 = " + pair_value("acc[q * 8 + h * 2]", "acc[q * 8 + h * 2 + 1]",
                                                    "row", "c0"))
    w("                        v1 = " + pair_value("acc[q * 8 + 4 + h * 2]",
                                                    "acc[q * 8 + 4 + h * 2 + 1]", "row", "(c0 + 4)"))
    w("                        other = T.cuda.__shfl_xor_sync(T.uint32(4294967295), "
      "T.Select(r % 2 == 1, v0, v1), 1, 32)")
    w("                        pair[0] = T.Select(r % 2 == 0, v0, other)")
    w("                        pair[1] = T.Select(r % 2 == 0, other, v1)")
    w("                        c = c0 + (r % 2) * 3")
    sp = "                        "
    if guarded:
        w(f"{sp}if row < {p.m} and c < {n_out}:")
        sp += "    "
    w(f"{sp}C2[row, T.Ramp(c, 1, 2)] = pair[T.Ramp(0, 1, 2)]")


def standalone(problem: GemmProblem, cfg: GemmConfig | None = None,
               row_stats: RowStats | None = None):
    """The kernel as a PrimFunc ``main(A, B, C)`` with ``C = cast(A·B)`` (no epilogue); with
    ``row_stats``, ``C = cast(rstd ⊙ (A·B − mean))`` (LayerNorm) or ``cast(rstd ⊙ A·B)``.

    For tests and device probes; the schedule rule builds its kernels from fused PrimFuncs.
    """
    from tvm.script import tirx as T
    from tvm.script.parser.core.entry import parse

    cfg = cfg or GemmConfig()
    p = problem
    b_shape = (p.n, p.k) if p.layout == "nt" else (p.k, p.n)
    decls = [("A", (p.m, p.k), p.in_dtype), ("B", b_shape, p.in_dtype),
             ("C", (p.m, p.n), p.out_dtype)]
    value = None
    if row_stats is not None:
        centred = f"({{acc}} - {ROW_MEAN})" if row_stats.centered else "{acc}"

        def value(acc: str, row: str, col: str) -> str:
            return f'T.Cast("{p.out_dtype}", {centred.format(acc=acc)} * {ROW_RSTD})'

    text = kernel_text(p, cfg, "main", ["A", "B", "C"], 0, 1, 2, decls, value,
                       row_stats=row_stats)
    return parse(text, extra_vars={"T": T})
