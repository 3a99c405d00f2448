"""FlashAttention prefill kernel for sm_90a (FA3-style): TMA → mbarrier ring → wgmma, in TIRx.

One CTA per (query tile of ``BM = 64·consumers`` rows, query head, batch), ``1 + consumers``
warpgroups (warp specialisation)::

    warpgroup 0 (producer, one thread)   Q tile once, then K_j, V_j per KV tile by TMA (4-D tensor
                                         maps over (D, H, S, B), or (D, S, H, B) for the BHSD
                                         layout, 128-byte swizzle, OOB rows = 0)
                                         into an NS-stage ring guarded by full/empty mbarriers
    warpgroup w ≥ 1 (consumer, 64 rows) for each KV tile j (causal: diagonal tiles first, tiles
                                         right of the diagonal skipped; sliding window: the
                                         loop starts at the tile of the tile's first visible
                                         key, tiles left of the band are never loaded):
        S  = Q·K_jᵀ                      wgmma m64n{BN}k16, A and B from shared (SS), fp32
        [S = tanh(S·scale/cap)]          soft-capped (spec.softcap): tanh.approx.f32, and ``cap``
                                         in place of ``scale`` below (spec.score_unit)
        S  masked (−inf) on diagonal / ragged / window-edge tiles only; with an additive bias
                                         S += bias / u (so that S·c adds bias·log2e)
        m' = max(m, rowmax S·c);  α = 2^(m − m');  P = 2^(S·c − m');  l = α·l + rowsum P
                                         (c = u·log2e folded into one FFMA; u = scale, or
                                         cap when soft-capped: spec.score_unit)
        O  = α·O + P·V_j                 wgmma m64n{D}k16, A = P from registers (RS), B = V
                                         read MN-major from shared (trans-b)
    out = O / l (rows that see no key: 0), stored from registers, rows ≥ Sq masked.

Persistent (``persistent_ctas`` = P > 0): P CTAs (one per SM) each take the query tiles
``k·P + bid`` (even rounds k) and ``k·P + P − 1 − bid`` (odd rounds; with causal's longest-first
order each CTA then gets long and short tiles alike). The producer loads tile k's Q once the
consumers released tile k−1's (a ``q_empty`` barrier they arrive at after their last GEMM), the
K/V ring's stage and phase follow a running count of KV tiles across the CTA's tiles, and O is
staged in a tile of its own whose TMA store completes while the next tile computes: the next
tile's Q and first K/V load during this tile's epilogue.

S and P stay in registers. The kernel is a ``@T.prim_func`` with ``@T.inline`` helpers (closures
over the spec and config; loops unrolled at generation time emit through the IR builder), tagged
``tvmfuse.tirx`` so :func:`.gemm_sm90.uses_tirx` sends the build through the hybrid pipeline.
Covers fp16 / bf16, head dim 64 / 128, causal kinds, sliding windows, GQA / MQA, any Sq / Skv (D·2 bytes is a
multiple of 16, so TMA strides are legal), and an additive bias of any broadcast shape (B|1, Hq|1,
Sq|1, Skv) (padding masks, T5's relative positions: the kernel's fifth parameter, read from global
memory per score element where it varies, once per key column where it is (…, 1, Skv)). Other
specs fall back to the sm80-style kernel (:func:`check`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ...attrs import RULE_ATTR, SPEC_ATTR, TIRX_ATTR
from .cpu import bias_strides
from .spec import AttentionSpec, at, band_tiles, causal_offset, masked, spec_json, tile_end

_LOG2E = math.log2(math.e)
_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
WG = 128  # threads per warpgroup
SW128 = 3  # CU_TENSOR_MAP_SWIZZLE_128B / wgmma descriptor swizzle code
NAME = "flash_attention_sm90"


@dataclass(frozen=True)
class Sm90FlashConfig:
    """Tile: ``consumers`` warpgroups × 64 query rows, ``block_n`` keys, ``stages`` K/V buffers."""

    consumers: int = 2
    block_n: int = 128
    stages: int = 2
    producer_regs: int = 24
    consumer_regs: int = 240
    overlap: bool = True  # FA3 intra-warpgroup overlap: softmax of S_j while P_{j-1}·V runs
    pingpong: bool = True  # named barriers: the two consumers take turns issuing GEMMs
    tma_store: bool = True  # O via shared memory + TMA store (out dtype = input dtype only)
    # > 0: that many CTAs (one per SM) loop over the query tiles, tile k·grid + (bid, or on odd
    # rounds grid − 1 − bid); the next tile's Q and K/V load during this tile's epilogue and O
    # is staged in a tile of its own. 0: one CTA per query tile
    persistent_ctas: int = 0

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return WG * (1 + self.consumers)


def default_config(spec: AttentionSpec) -> Sm90FlashConfig:
    """BM 128 × BN 128, 2 stages, overlap + ping-pong + TMA store: the fastest measured on the
    H200 at D 128 (tools/bench/NOTES.md); D 64 uses the same tile (a third stage is untimed)."""
    del spec
    return Sm90FlashConfig()


def smem_bytes(spec: AttentionSpec, cfg: Sm90FlashConfig) -> int:
    """Q tile + ``stages`` × (K tile + V tile) (+ persistent with TMA store: an O staging tile),
    2-byte elements."""
    o_tile = cfg.block_m if cfg.persistent_ctas and cfg.tma_store else 0
    return 2 * spec.head_dim * (cfg.block_m + 2 * cfg.stages * cfg.block_n + o_tile)


def check(spec: AttentionSpec, cfg: Sm90FlashConfig | None = None) -> str | None:
    """Why this kernel cannot compute ``spec`` (the caller falls back), or None."""
    cfg = cfg or default_config(spec)
    if spec.dtype not in _PTX_TYPE:
        return f"dtype {spec.dtype} unsupported (float16 or bfloat16)"
    if spec.result_dtype not in _PTX_TYPE and spec.result_dtype != "float32":
        return f"output dtype {spec.result_dtype} unsupported"
    if spec.value_dim_differs:
        return spec.value_dim_differs
    if spec.head_dim not in (64, 128):
        return f"head_dim {spec.head_dim} unsupported (64 or 128)"
    if spec.bias_shape is not None:
        try:
            bias_strides(spec)
        except ValueError as err:
            return str(err)
    if not spec.scale > 0:
        return f"scale must be positive, not {spec.scale}"
    if cfg.block_n % 64 or not 64 <= cfg.block_n <= 256 or cfg.consumers not in (1, 2, 3):
        return f"tile {cfg} unsupported"
    if cfg.persistent_ctas < 0:
        return f"persistent_ctas must be ≥ 0, not {cfg.persistent_ctas}"
    if smem_bytes(spec, cfg) > 227 * 1024:
        return f"{smem_bytes(spec, cfg)} bytes of shared memory exceed 227 KiB"
    n_elems = spec.batch * max(spec.q_len, spec.kv_len) * spec.q_heads * spec.head_dim
    if n_elems >= 2**31:
        return "tensor beyond int32 indexing"
    return None


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _plus(a, b):
    """``a + b``, or ``b`` itself when ``a`` is the Python int 0 (the one-tile kernel's counters)."""
    return b if isinstance(a, int) and a == 0 else a + b


def _emit(res) -> None:
    """An expression statement as TVMScript emits it (a call's value becomes an Evaluate)."""
    if res is not None:
        T.evaluate(res)


def flash_kernel(spec: AttentionSpec, cfg: Sm90FlashConfig) -> tirx.PrimFunc:
    """The kernel ``main(q, k, v, [bias,] out)`` for ``spec`` (checked by :func:`check`)."""
    B, Sq, Skv, Hq, Hkv, D = (spec.batch, spec.q_len, spec.kv_len, spec.q_heads, spec.kv_heads,
                              spec.head_dim)
    G = spec.group
    in_dt, odt = spec.dtype, spec.result_dtype
    QKV_L, OUT_L = spec.qkv_layout, spec.out_layout  # memory layouts (spec.at)
    ab = _PTX_TYPE[in_dt]
    BM, BN, NS, NC = cfg.block_m, cfg.block_n, cfg.stages, cfg.consumers
    DC = D // 64  # 64-element (128-byte) chunks per row: one TMA box / swizzle atom column each
    n_m = _cdiv(Sq, BM)
    causal = causal_offset(spec) is not None
    c_log2 = float(spec.score_unit * _LOG2E)
    cap_in = spec.tanh_scale
    has_bias = spec.bias_shape is not None
    fb, fh, fi = bias_strides(spec) if has_bias else (0, 0, 0)
    bias_shape = spec.bias_shape if has_bias else (1, 1, 1, 1)
    bdt = spec.bias_dtype or in_dt
    inv_scale = tirx.const(1.0 / spec.score_unit, "float32")
    # shared layout (elements): Q [DC][BM][64] | K [NS][DC][BN][64] | V [NS][DC][BN][64]
    q_chunk, kv_chunk = BM * 64, BN * 64
    kv_tile = DC * kv_chunk
    k_off = DC * q_chunk
    v_off = k_off + NS * kv_tile
    total = v_off + NS * kv_tile
    persistent = cfg.persistent_ctas > 0
    n_tiles = n_m * Hq * B
    grid = min(cfg.persistent_ctas, n_tiles) if persistent else n_tiles
    n_rounds = _cdiv(n_tiles, grid)
    o_off = 0  # the O staging tile: Q's rows, or (persistent) a tile after the K/V ring
    if persistent and cfg.tma_store:
        o_off, total = total, total + BM * D
    q_bytes, kv_bytes = BM * D * 2, BN * D * 2
    s_n, o_n = BN // 2, D // 2  # fp32 accumulators per consumer thread (64 × N / 128)
    heads_batch, last_tile, ns_m1 = Hq * B, n_m - 1, NS - 1
    v_lbo = kv_chunk * 2 // 16
    two_wg = 2 * WG
    mma_s = T.ptx[f"wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.{ab}.{ab}"]
    mma_o = T.ptx[f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab}"]
    tma = T.ptx["cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"]
    cvt = T.ptx[f"cvt.rn.{ab}x2.f32"]
    tma_st = T.ptx["cp.async.bulk.tensor.4d.global.shared::cta.bulk_group"]
    to_shared = T.cuda.cvta_generic_to_shared
    tma_store = cfg.tma_store and odt == in_dt

    def encode_map(tmap, buf, layout: str, heads: int, seq: int, rows: int):
        # host: 4-D tensor map over the buffer's dims innermost first ((D, H, S, B) for BSHD,
        # (D, S, H, B) for BHSD), byte strides of the outer three, box of 64 d × ``rows`` positions,
        # element strides 1, no interleave, 128B swizzle, L2 256B, OOB zeros
        dims = at(layout, B, seq, heads, D)[::-1]
        box = at(layout, 1, rows, 1, 64)[::-1]
        strides = (dims[0] * 2, dims[0] * dims[1] * 2, dims[0] * dims[1] * dims[2] * 2)
        return T.call_packed("runtime.cuTensorMapEncodeTiled", tmap, in_dt, 4, buf.data, *dims,
                             *strides, *box, 1, 1, 1, 1, 0, SW128, 2, 0)

    def tile_row(bid):
        # causal: the longest query tiles first; the heads and batches of one tile run side by side
        return last_tile - bid // heads_batch if causal else bid // heads_batch

    def round_tile(kq, bid):
        # persistent: the CTA's tile of round kq, alternating direction so that each CTA gets
        # long and short causal tiles alike
        return kq * grid + tirx.if_then_else(kq % 2 == 0, bid, grid - 1 - bid)

    def tile_iters(tile):
        # the KV tiles a query tile visits (the producer's and consumers' running counter)
        m0 = tile_row(tile) * BM
        n_end = tile_end(spec, tirx.min(m0 + BM, Sq) - 1, BN)
        if spec.window is None:
            return n_end
        return n_end - band_tiles(spec, m0, tirx.min(m0 + BM, Sq) - 1, BN, n_end)[0]

    def tma_rows(smem, tmap, base, chunk: int, head, row, b, bar) -> None:
        """One TMA box per 64-element d-chunk c: rows ``row..`` of ``head`` into ``base + c·chunk``."""
        for c in range(DC):
            _emit(tma(to_shared(smem.ptr_to([base + c * chunk])), T.address_of(tmap),
                      *at(QKV_L, b, row, head, c * 64)[::-1], to_shared(bar)))

    def store_o(tmap, smem, h, m0, wg, b) -> None:
        for c in range(DC):
            _emit(tma_st(T.address_of(tmap), *at(OUT_L, b, m0 + wg * 64, h, c * 64)[::-1],
                         to_shared(smem.ptr_to([_plus(o_off, c * q_chunk + wg * 4096)]))))

    def mma_qk(s_acc, desc_q, desc_k, stage) -> None:
        # S = Q·Kᵀ: k16 step kk reads 32 bytes into the 128-byte row of d-chunk kk // 4
        for kk in range(D // 16):
            a_off = ((kk // 4) * q_chunk * 2 + (kk % 4) * 32) // 16
            b_off = (stage * (kv_tile * 2) + ((kk // 4) * kv_chunk * 2 + (kk % 4) * 32)) // 16
            _emit(mma_s(*[s_acc[i] for i in range(s_n)], desc_q[0] + T.uint64(a_off),
                        desc_k[0] + T.uint64(b_off), kk > 0, 1, 1, 0, 0))

    def mma_pv(o_acc, p_frag, desc_v, stage) -> None:
        # O += P·V: k16 step kt = keys 16kt.. = 16 rows of 128 B in every d-chunk
        for kt in range(BN // 16):
            b_off = (stage * (kv_tile * 2) + kt * 16 * 128) // 16
            _emit(mma_o(*[o_acc[i] for i in range(o_n)], p_frag[kt * 4], p_frag[kt * 4 + 1],
                        p_frag[kt * 4 + 2], p_frag[kt * 4 + 3], desc_v[0] + T.uint64(b_off),
                        True, 1, 1, 1))

    @T.prim_func
    def main(q_h: T.handle, k_h: T.handle, v_h: T.handle, b_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q = T.match_buffer(q_h, spec.q_shape, in_dt, align=16)
        k = T.match_buffer(k_h, spec.kv_shape, in_dt, align=16)
        v = T.match_buffer(v_h, spec.kv_shape, in_dt, align=16)
        bias = T.match_buffer(b_h, bias_shape, bdt)  # without a bias: dropped below, never read
        out = T.match_buffer(o_h, spec.out_shape, odt, align=16)
        Q_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        encode_map(Q_map, q, QKV_L, Hq, Sq, BM)
        K_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        encode_map(K_map, k, QKV_L, Hkv, Skv, BN)
        V_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        encode_map(V_map, v, QKV_L, Hkv, Skv, BN)
        if tma_store:
            O_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            encode_map(O_map, out, OUT_L, Hq, Sq, 64)
        T.device_entry()
        bid = T.cta_id([grid])
        tx = T.thread_id([cfg.threads])
        smem = T.alloc_buffer((total,), in_dt, scope="shared.dyn", align=1024)
        if tma_store:
            smem32 = T.decl_buffer((total // 2,), "uint32", data=smem.data, scope="shared.dyn")
        q_full = T.alloc_shared([1], "uint64")
        k_full = T.alloc_shared([NS], "uint64")
        k_empty = T.alloc_shared([NS], "uint64")
        v_full = T.alloc_shared([NS], "uint64")
        v_empty = T.alloc_shared([NS], "uint64")
        if persistent:
            q_empty = T.alloc_shared([1], "uint64")
        if tx == 0:
            T.ptx.mbarrier.init.shared.b64(to_shared(q_full.ptr_to([0])), T.uint32(1))
            if persistent:
                T.ptx.mbarrier.init.shared.b64(to_shared(q_empty.ptr_to([0])), T.uint32(NC * WG))
            for s in T.unroll(NS):
                T.ptx.mbarrier.init.shared.b64(to_shared(k_full.ptr_to([s])), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(to_shared(v_full.ptr_to([s])), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(to_shared(k_empty.ptr_to([s])), T.uint32(NC * WG))
                T.ptx.mbarrier.init.shared.b64(to_shared(v_empty.ptr_to([s])), T.uint32(NC * WG))
        T.ptx.fence.mbarrier_init.release.cluster()
        T.cuda.cta_sync()

        @T.inline
        def each_tile(work):
            # work(tile, k, KV tiles before it): the CTA's one tile, or (persistent) its rounds
            if persistent:
                done = T.alloc_buffer((1,), "int32", scope="local")
                done[0] = 0
                for kq in T.serial(n_rounds):
                    tile = round_tile(kq, bid)
                    if tile < n_tiles:
                        work(tile, kq, done[0])
                        done[0] = done[0] + tile_iters(tile)
            else:
                work(bid, 0, 0)

        if tx // 128 == 0:
            T.ptx["setmaxnreg.dec.sync.aligned.u32"](cfg.producer_regs)
            if tx == 0:

                @T.inline
                def load_kv(tmap, full, empty, base, c, s, j, g, b):
                    # the c-th K (V) tile this CTA loads: stage s = c % NS, free once the
                    # consumers released its previous use
                    if c >= NS:
                        T.cuda.mbarrier_wait(empty.ptr_to([s]), (c // NS + 1) % 2)
                    T.ptx.mbarrier.arrive.expect_tx.shared.b64(to_shared(full.ptr_to([s])),
                                                               T.uint32(kv_bytes))
                    tma_rows(smem, tmap, base + s * kv_tile, kv_chunk, g, j * BN, b,
                             full.ptr_to([s]))

                @T.inline
                def produce(tile, kq, kvc):
                    # Q once (persistent: after the consumers released the previous tile's Q),
                    # then the tile's KV tiles in processing order: the jj-th is j = n_end − 1 − jj
                    m0 = tile_row(tile) * BM
                    b = (tile % heads_batch) // Hq
                    h = tile % Hq
                    g = h // G
                    n_end = tile_end(spec, T.min(m0 + BM, Sq) - 1, BN)
                    if spec.window is None:
                        n_it = T.meta_var(n_end)
                    else:
                        n_it = n_end - band_tiles(spec, m0, T.min(m0 + BM, Sq) - 1, BN, n_end)[0]
                    if persistent:
                        if kq > 0:
                            T.cuda.mbarrier_wait(q_empty.ptr_to([0]), (kq + 1) % 2)
                    T.ptx.mbarrier.arrive.expect_tx.shared.b64(to_shared(q_full.ptr_to([0])),
                                                               T.uint32(q_bytes))
                    tma_rows(smem, Q_map, 0, q_chunk, h, m0, b, q_full.ptr_to([0]))
                    for jj in T.serial(n_it):
                        c = T.meta_var(_plus(kvc, jj))
                        s = c % NS
                        j = n_end - 1 - jj
                        load_kv(K_map, k_full, k_empty, k_off, c, s, j, g, b)
                        load_kv(V_map, v_full, v_empty, v_off, c, s, j, g, b)

                each_tile(produce)
        else:
            T.ptx["setmaxnreg.inc.sync.aligned.u32"](cfg.consumer_regs)
            s_acc = T.alloc_buffer((s_n,), "float32", scope="local")
            o_acc = T.alloc_buffer((o_n,), "float32", scope="local")
            p_frag = T.alloc_buffer((BN // 4,), "uint32", scope="local")
            m_i = T.alloc_buffer((2,), "float32", scope="local")
            l_i = T.alloc_buffer((2,), "float32", scope="local")
            st = T.alloc_buffer((4,), "float32", scope="local")
            alpha = T.alloc_buffer((2,), "float32", scope="local")
            desc_q = T.alloc_buffer((1,), "uint64", scope="local")
            desc_k = T.alloc_buffer((1,), "uint64", scope="local")
            desc_v = T.alloc_buffer((1,), "uint64", scope="local")
            if has_bias:
                bias_v = T.alloc_buffer((1,), "float32", scope="local")
            wg = tx // 128 - 1
            t = tx % 128
            col0 = (t % 4) * 2
            # descriptors: K-major 128B-swizzled Q / K (LBO unused, SBO 1024 B between 8-row
            # groups); V MN-major (LBO = one 64-column chunk of BN rows, SBO 1024 B)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_q[0]), smem.ptr_to([wg * 4096]),
                                                  1, 64, SW128)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_k[0]), smem.ptr_to([k_off]),
                                                  1, 64, SW128)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_v[0]), smem.ptr_to([v_off]),
                                                  v_lbo, 64, SW128)

            @T.inline
            def issue_s(stage):
                mma_qk(s_acc, desc_q, desc_k, stage)
                T.ptx.wgmma.commit_group.sync.aligned()

            @T.inline
            def issue_pv(stage):
                mma_pv(o_acc, p_frag, desc_v, stage)
                T.ptx.wgmma.commit_group.sync.aligned()

            @T.inline
            def mask_tile(j, row0):
                # keys past Skv, (causal) right of the diagonal, (window) left of the band
                for jn in T.unroll(BN // 8):
                    for x in T.unroll(4):
                        col = j * BN + jn * 8 + col0 + x % 2
                        if masked(spec, row0 + (x // 2) * 8, col):
                            s_acc[jn * 4 + x] = T.float32("-inf")

            @T.inline
            def mask(jj, j, row0, n_mask, n_edge):
                # only the first n_mask tiles and (window) the last ones, from n_edge on
                if spec.window is None:
                    if jj < n_mask:
                        mask_tile(j, row0)
                else:
                    if jj < n_mask or jj >= n_edge:
                        mask_tile(j, row0)

            @T.inline
            def add_bias(j, row0, b, h):
                # S += bias / u: the softmax's S·c (c = u·log2e, u = spec.score_unit) then adds
                # bias·log2e.
                # Columns past Skv are masked already (−inf) and read nothing; rows past Sq read
                # the last row's bias (their results are never stored).
                for jn in T.unroll(BN // 8):
                    for e in T.unroll(2):
                        col = j * BN + jn * 8 + col0 + e
                        if Skv % BN == 0:
                            bias_column(jn * 4 + e, b, h, row0, col)
                        elif col < Skv:
                            bias_column(jn * 4 + e, b, h, row0, col)

            @T.inline
            def bias_column(i, b, h, row0, col):
                # the thread's two rows (row0, row0 + 8) of one column: accumulators i, i + 2
                if fi == 0:  # (…, 1, Skv): one load for both rows
                    bias_v[0] = T.Cast("float32", bias[b * fb, h * fh, 0, col]) * inv_scale
                    s_acc[i] = s_acc[i] + bias_v[0]
                    s_acc[i + 2] = s_acc[i + 2] + bias_v[0]
                else:
                    for r in T.unroll(2):
                        s_acc[i + r * 2] = s_acc[i + r * 2] + T.Cast("float32", bias[
                            b * fb, h * fh, T.min(row0 + r * 8, Sq - 1), col]) * inv_scale

            @T.inline
            def soft_cap():
                # S = tanh(S · scale / cap): one MUFU.TANH per score; c_log2 and the bias then
                # scale by cap (spec.score_unit)
                for i in T.unroll(s_n):
                    T.ptx["tanh.approx.f32"](s_acc[i], s_acc[i] * T.float32(cap_in))

            @T.inline
            def mask_and_bias(jj, j, row0, n_mask, n_edge, b, h):
                if cap_in is not None:
                    soft_cap()
                mask(jj, j, row0, n_mask, n_edge)
                if has_bias:
                    add_bias(j, row0, b, h)

            @T.inline
            def rescale():
                for dn in T.unroll(D // 8):
                    for x in T.unroll(4):
                        o_acc[dn * 4 + x] = o_acc[dn * 4 + x] * alpha[x // 2]

            @T.inline
            def softmax(rescale_now):
                # a thread holds rows row0 and row0 + 8; a row lives in a quad of lanes.
                # alpha[r] = 2^(m − m'); O is rescaled here or (overlap) once the P·V in flight
                # retired
                for r in T.unroll(2):
                    st[0] = m_i[r]
                    for jn in T.unroll(BN // 8):
                        st[0] = T.max(st[0], T.max(s_acc[jn * 4 + r * 2], s_acc[jn * 4 + r * 2 + 1])
                                      * T.float32(c_log2))
                    st[0] = T.max(st[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[0], 1, 32, 32))
                    st[0] = T.max(st[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[0], 2, 32, 32))
                    # m' = −inf: nothing visible yet; subtract 0 so 2^(−inf) = 0, not NaN
                    st[1] = T.if_then_else(st[0] == T.float32("-inf"), T.float32(0), st[0])
                    alpha[r] = T.exp2(m_i[r] - st[1])
                    m_i[r] = st[0]
                    l_i[r] = l_i[r] * alpha[r]
                    for jn in T.unroll(BN // 8):
                        for x in T.unroll(2):
                            T.ptx["ex2.approx.ftz.f32"](s_acc[jn * 4 + r * 2 + x],
                                                        s_acc[jn * 4 + r * 2 + x] * T.float32(c_log2)
                                                        - st[1])
                            l_i[r] = l_i[r] + s_acc[jn * 4 + r * 2 + x]
                if rescale_now:
                    rescale()

            @T.inline
            def to_p():
                # P → A fragments: register i packs accumulators 2i (low half) and 2i + 1 (high)
                for i in T.unroll(BN // 4):
                    cvt(p_frag[i], s_acc[2 * i + 1], s_acc[2 * i])

            @T.inline
            def turn_wait():
                # ping-pong: warpgroup wg issues its GEMMs only after the other one issued theirs
                if cfg.pingpong:
                    T.ptx["bar.sync"](T.uint32(1 + wg), T.uint32(two_wg))

            @T.inline
            def turn_pass():
                if cfg.pingpong:
                    T.ptx["bar.arrive"](T.uint32(2 - wg), T.uint32(two_wg))

            @T.inline
            def consume(tile, kq, kvc):
                # one query tile: the KV loop, then O / l stored; kvc KV tiles came before it
                m0 = tile_row(tile) * BM
                b = (tile % heads_batch) // Hq
                h = tile % Hq
                row0 = m0 + wg * 64 + (t // 32) * 16 + (t % 32) // 4
                # KV tiles [n_start, n_end) hold a key visible to some row of the tile, [n_lo,
                # n_full) only keys visible to every row (spec.band_tiles; no window: n_start =
                # n_lo = 0); processed from the right: the jj-th of n_it tiles is j = n_end − 1 − jj
                n_end = tile_end(spec, T.min(m0 + BM, Sq) - 1, BN)
                n_full = band_tiles(spec, m0, T.min(m0 + BM, Sq) - 1, BN, n_end)[2]
                n_mask = n_end - n_full  # diagonal / ragged tiles: jj < n_mask
                if spec.window is None:
                    n_it = T.meta_var(n_end)
                    n_edge = T.meta_var(n_end)
                else:
                    n_start = band_tiles(spec, m0, T.min(m0 + BM, Sq) - 1, BN, n_end)[0]
                    n_lo = band_tiles(spec, m0, T.min(m0 + BM, Sq) - 1, BN, n_end)[1]
                    n_it = n_end - n_start
                    n_edge = n_end - n_lo  # window-edge tiles: jj ≥ n_edge
                for i in T.unroll(o_n):
                    o_acc[i] = T.float32(0)
                for i in T.unroll(2):
                    m_i[i] = T.float32("-inf")
                    l_i[i] = T.float32(0)
                T.cuda.mbarrier_wait(q_full.ptr_to([0]), kq % 2)
                if not cfg.overlap:
                    for jj in T.serial(n_it):
                        c = T.meta_var(_plus(kvc, jj))
                        s = c % NS
                        ph = (c // NS) % 2
                        j = n_end - 1 - jj
                        T.cuda.mbarrier_wait(k_full.ptr_to([s]), ph)
                        turn_wait()
                        T.ptx.wgmma.fence.sync.aligned()
                        issue_s(s)
                        turn_pass()
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        T.ptx.mbarrier.arrive.shared.b64(to_shared(k_empty.ptr_to([s])))
                        mask_and_bias(jj, j, row0, n_mask, n_edge, b, h)
                        softmax(True)
                        to_p()
                        T.cuda.mbarrier_wait(v_full.ptr_to([s]), ph)
                        T.ptx.wgmma.fence.sync.aligned()
                        issue_pv(s)
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        T.ptx.mbarrier.arrive.shared.b64(to_shared(v_empty.ptr_to([s])))
                else:
                    # FA3 intra-warpgroup overlap: S_jj = Q·K_jjᵀ and O += P_{jj−1}·V_{jj−1} in
                    # flight together; the softmax of S_jj runs while the P·V wgmma still executes
                    if n_it > 0:
                        T.cuda.mbarrier_wait(k_full.ptr_to([kvc % NS]), (kvc // NS) % 2)
                        turn_wait()
                        T.ptx.wgmma.fence.sync.aligned()
                        issue_s(kvc % NS)
                        turn_pass()
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        T.ptx.mbarrier.arrive.shared.b64(to_shared(k_empty.ptr_to([kvc % NS])))
                        mask_and_bias(0, n_end - 1, row0, n_mask, n_edge, b, h)
                        softmax(False)
                        to_p()
                    for jj in T.serial(1, n_it):
                        c = T.meta_var(_plus(kvc, jj))
                        s = c % NS
                        sp = (c + ns_m1) % NS
                        j = n_end - 1 - jj
                        T.cuda.mbarrier_wait(k_full.ptr_to([s]), (c // NS) % 2)
                        T.cuda.mbarrier_wait(v_full.ptr_to([sp]), ((c - 1) // NS) % 2)
                        turn_wait()
                        T.ptx.wgmma.fence.sync.aligned()
                        issue_s(s)
                        issue_pv(sp)
                        turn_pass()
                        T.ptx.wgmma.wait_group.sync.aligned(1)
                        T.ptx.mbarrier.arrive.shared.b64(to_shared(k_empty.ptr_to([s])))
                        mask_and_bias(jj, j, row0, n_mask, n_edge, b, h)
                        softmax(False)
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        T.ptx.mbarrier.arrive.shared.b64(to_shared(v_empty.ptr_to([sp])))
                        rescale()
                        to_p()
                    if n_it > 0:
                        cl = T.meta_var(_plus(kvc, n_it - 1))
                        sl = cl % NS
                        T.cuda.mbarrier_wait(v_full.ptr_to([sl]), (cl // NS) % 2)
                        T.ptx.wgmma.fence.sync.aligned()
                        issue_pv(sl)
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        T.ptx.mbarrier.arrive.shared.b64(to_shared(v_empty.ptr_to([sl])))
                if persistent:  # every GEMM reading this tile's Q retired: the next Q may load
                    T.ptx.mbarrier.arrive.shared.b64(to_shared(q_empty.ptr_to([0])))
                # out = O / l   (l summed over the quad)
                for r in T.unroll(2):
                    st[0] = l_i[r]
                    st[0] = st[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[0], 1, 32, 32)
                    st[0] = st[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[0], 2, 32, 32)
                    alpha[r] = T.if_then_else(st[0] > T.float32(0), T.float32(1) / st[0],
                                              T.float32(0))
                if tma_store:
                    # O tile → this warpgroup's rows of the staging tile (the idle Q rows, or
                    # persistent: a tile of its own, free once the last store read it) in the same
                    # 128B-swizzled layout, then one TMA store per d-chunk (rows ≥ Sq clipped)
                    if persistent:
                        if kq > 0:
                            if t == 0:
                                T.ptx["cp.async.bulk.wait_group.read"](0)
                            T.ptx["bar.sync"](T.uint32(3 + wg), T.uint32(WG))
                    row_l = (t // 32) * 16 + (t % 32) // 4
                    for dn in T.unroll(D // 8):
                        for r in T.unroll(2):
                            cvt(p_frag[0], o_acc[dn * 4 + r * 2 + 1] * alpha[r],
                                o_acc[dn * 4 + r * 2] * alpha[r])
                            smem32[_plus(o_off, (dn // 8) * q_chunk + wg * 4096 + (row_l + r * 8) * 64
                                    + T.bitwise_xor(dn % 8, (row_l + r * 8) % 8) * 8 + col0) // 2] = (
                                p_frag[0])
                    T.ptx["fence.proxy.async.shared::cta"]()
                    T.ptx["bar.sync"](T.uint32(3 + wg), T.uint32(WG))
                    if t == 0:
                        store_o(O_map, smem, h, m0, wg, b)
                        T.ptx["cp.async.bulk.commit_group"]()
                        if not persistent:
                            T.ptx["cp.async.bulk.wait_group.read"](0)
                else:
                    for r in T.unroll(2):
                        if row0 + r * 8 < Sq:
                            for dn in T.unroll(D // 8):
                                for x in T.unroll(2):
                                    out[at(OUT_L, b, row0 + r * 8, h, dn * 8 + col0 + x)] = T.Cast(
                                        odt, o_acc[dn * 4 + r * 2 + x] * alpha[r])

            if cfg.pingpong:
                if wg == 1:  # warpgroup 0 goes first
                    T.ptx["bar.arrive"](T.uint32(1), T.uint32(two_wg))
            each_tile(consume)
            if persistent and tma_store:
                if t == 0:  # the last store has read its staging tile before the CTA exits
                    T.ptx["cp.async.bulk.wait_group.read"](0)
            if cfg.pingpong:
                if wg == 0:  # consume warpgroup 1's last hand-over
                    T.ptx["bar.sync"](T.uint32(1), T.uint32(two_wg))

    if has_bias:
        return main
    # no bias: the kernel is (q, k, v, out); its body never reads the bias buffer
    params = [p for i, p in enumerate(main.params) if i != 3]
    return tirx.PrimFunc(params, main.body, main.ret_type, main.attrs)


def flash_attention_sm90_primfunc(spec: AttentionSpec, target: tvm.target.Target | None = None,
                                  config: Sm90FlashConfig | None = None,
                                  name: str | None = None) -> tvm.tirx.PrimFunc:
    """PrimFunc ``(q, k, v, [bias,] out)`` for ``spec`` on sm_90a; ValueError when not covered.

    ``name``: keep a global symbol (standalone builds); inside a Relax module the build names it.
    """

    cfg = config or default_config(spec)
    reason = check(spec, cfg)
    if reason:
        raise ValueError(f"flash attention sm90a: {reason}")
    func = flash_kernel(spec, cfg)
    attrs = {"tirx.is_scheduled": True, "tir.is_scheduled": True, RULE_ATTR: NAME,
             TIRX_ATTR: True,
             "tvmfuse.tile": f"{cfg.block_m}x{cfg.block_n} stages={cfg.stages}",
             SPEC_ATTR: spec_json(spec)}  # tvmfuse tune regenerates the kernel from it
    func = func.with_attrs(attrs)
    return func.with_attr("global_symbol", name) if name else func.without_attr("global_symbol")
