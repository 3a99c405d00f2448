"""FlashAttention-2-style prefill kernel for CUDA (sm80 path: cp.async + ldmatrix + mma.sync).

One thread block per (query tile of ``BM`` rows, query head, batch); ``NW`` warps, each owning
``MT`` m16 row slices of the tile (``BM = 16·MT·NW``). Per block::

    Q tile  (BM × D)  → shared (cp.async) → registers (ldmatrix), once
    for each KV tile n (BN keys; causal: only tiles left of the diagonal; sliding window: from the
                        tile of the first key in the band, tiles left of it never loaded):
        K_n, V_n  → shared (rows of D and Dv), NS-stage cp.async ring (tile n+NS−1 loads while n computes)
        S  = Q·K_nᵀ                      mma.sync m16n8k16, fp32 accumulators in registers
        [S = tanh(S·scale/c)]            soft-capped (spec.softcap c): tanh.approx.f32, then c in
                                         place of scale below (spec.score_unit)
        S  = S·scale·log2e (+ bias·log2e), −inf where masked (diagonal/ragged/window-edge tiles only)
        m' = max(m, rowmax S);  α = 2^(m − m');  P = 2^(S − m');  l = α·l + rowsum P
        O  = α·O + P·V_n                 P re-packed to fp16/bf16 as the A operand in registers
    out = O / l                                              (rows that see no key: 0)

S and P never leave registers. Shared tiles are XOR-swizzled in 16-byte chunks (chunk ^ row%8;
D = 32: chunk ^ (row%8)/2, two 64-byte rows per bank line), so every ldmatrix phase hits 8
distinct bank groups. Loads past Sq/Skv are zero-filled
(cp.async src-size 0) and their keys masked. The kernel is written in TIR (TVMScript with the
``T.ptx`` instruction table) and goes through TVM's default CUDA lowering unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from .cpu import bias_strides
from .spec import AttentionSpec, at, band_tiles, causal_offset, full_tiles, masked, tile_end

_LOG2E = math.log2(math.e)
_NEG_INF = float("-inf")
_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class FlashConfig:
    """Tile sizes: ``BM = 16·m_tiles·warps`` query rows, ``block_n`` keys, ``stages`` KV buffers."""

    warps: int = 4
    m_tiles: int = 1
    block_n: int = 64
    stages: int = 2

    @property
    def block_m(self) -> int:
        return 16 * self.m_tiles * self.warps


def default_config(spec: AttentionSpec) -> FlashConfig:
    """Tile choice per head dim (measured on the H200; see tools/bench/NOTES.md)."""
    if spec.head_dim <= 64:
        return FlashConfig(warps=4, m_tiles=1, block_n=64, stages=2)
    return FlashConfig(warps=4, m_tiles=1, block_n=64, stages=2)


def check(spec: AttentionSpec) -> str | None:
    """Why this kernel cannot compute ``spec`` (callers fall back to another lowering), or None."""
    if spec.dtype not in _PTX_TYPE:
        return f"dtype {spec.dtype} unsupported (float16 or bfloat16)"
    if spec.value_dim == spec.head_dim and spec.head_dim not in (32, 64, 128):
        return f"head_dim {spec.head_dim} unsupported (32, 64 or 128)"
    if spec.value_dim != spec.head_dim and (spec.head_dim, spec.value_dim) != (192, 128):
        return (f"head dims {spec.head_dim} (q, k) and {spec.value_dim} (v) unsupported (MLA: "
                "192 with 128-wide values)")
    if not spec.scale > 0:
        return f"scale must be positive, not {spec.scale}"
    return None


def _check(spec: AttentionSpec) -> None:
    reason = check(spec)
    if reason:
        raise ValueError(f"flash attention: {reason}")


def flash_attention_primfunc(spec: AttentionSpec, target: tvm.target.Target | None = None,
                             config: FlashConfig | None = None) -> tvm.tirx.PrimFunc:
    """PrimFunc ``(q, k, v, [bias,] out)`` for ``spec`` (layout in ``attention.py``)."""
    _check(spec)
    cfg = config or default_config(spec)
    B, Sq, Skv, Hq, D = spec.batch, spec.q_len, spec.kv_len, spec.q_heads, spec.head_dim
    DV = spec.value_dim  # the head dim of v and out (D but for multi-head latent attention)
    G = spec.group
    dt, odt = spec.dtype, spec.result_dtype
    QKV_L, OUT_L = spec.qkv_layout, spec.out_layout  # memory layouts (spec.at)
    q_shape, kv_shape, v_shape, out_shape = spec.q_shape, spec.kv_shape, spec.v_shape, spec.out_shape
    ptx_t = _PTX_TYPE[dt]
    mma_op = f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_t}.{ptx_t}.f32"
    cvt_op = f"cvt.rn.{ptx_t}x2.f32"
    NW, MT, BN, NS = cfg.warps, cfg.m_tiles, cfg.block_n, cfg.stages
    BM = cfg.block_m
    NT = 32 * NW
    CH, CHV = D // 8, DV // 8  # 16-byte chunks per row of Q and K, of V
    # swizzle: chunk c of row r sits at c ^ ((r % 8) // SW). 128-byte rows and longer: SW 1, the
    # 8 rows of an ldmatrix phase take 8 chunk slots; 64-byte rows (D 32): two rows share a
    # 128-byte bank line, so row pairs take 4 chunk slots (SW 2) and the phase still spans all banks
    SW, SWV = 8 // min(CH, 8), 8 // min(CHV, 8)
    KD = D // 16  # k16 steps of Q·Kᵀ
    NN = BN // 8  # n8 tiles of S
    KN = BN // 16  # k16 steps of P·V
    ND = DV // 8  # n8 tiles of O
    n_m = (Sq + BM - 1) // BM
    has_bias = spec.bias_shape is not None
    fb, fh, fi = bias_strides(spec) if has_bias else (0, 0, 0)
    bias_shape = spec.bias_shape if has_bias else (1, 1, 1, 1)
    bdt = spec.bias_dtype or dt
    causal = causal_offset(spec) is not None
    sc = float(spec.score_unit * _LOG2E)
    cap_in = spec.tanh_scale
    # with a bias S is scaled before the max; otherwise the scale rides the exp2's FFMA
    s_mul = 1.0 if has_bias else sc
    l2e = float(_LOG2E)
    q_off, k_off = 0, BM * D
    v_off = k_off + NS * BN * D
    smem_elems = v_off + NS * BN * DV
    if BM * CH % NT or BN * CH % NT or BN * CHV % NT or NN % 2:
        raise ValueError(f"flash attention: tile config {cfg} does not divide over {NT} threads")
    n_q_loads = BM * CH // NT
    n_kv_loads, n_v_loads = BN * CH // NT, BN * CHV // NT
    # causal: heavy (long) query tiles first
    r_base, r_sign = (n_m - 1, -1) if causal else (0, 1)

    @T.macro
    def load_tile(smem, src, row0, n_rows, base, b, hh, tx, n_loads, ch, sw):
        # rows of 8·ch elements → swizzled 16-byte chunks (chunk ^ (row % 8) // sw); rows ≥ n_rows
        # read nothing (zero fill)
        for it in T.unroll(n_loads):
            r: T.let[T.int32] = (tx + it * NT) // ch
            c: T.let[T.int32] = (tx + it * NT) % ch
            T.ptx["cp.async.cg.shared.global"](
                    T.cuda.cvta_generic_to_shared(
                        T.address_of(smem[base + r * (ch * 8) + T.bitwise_xor(c, (r % 8) // sw) * 8])),
                    T.address_of(src[at(QKV_L, b, T.min(row0 + r, n_rows - 1), hh, c * 8)]),
                    16,
                    T.Cast("uint32", T.if_then_else(row0 + r < n_rows, 16, 0)),
                )

    @T.macro
    def kv_step(j, mask, smem, k, v, bias, s_acc, o_acc, q_frag, kb_frag, p_frag, m_i, l_i, st,
                b, h, g, m0, n_end, warp, lane, tx):
        # ring: wait until tile j is in shared, refill the stage tile j−1 used
        T.tvm_storage_sync("shared")
        if j + NS - 1 < n_end:
            load_tile(smem, k, (j + NS - 1) * BN, Skv, k_off + ((j + NS - 1) % NS) * BN * D,
                      b, g, tx, n_kv_loads, CH, SW)
            load_tile(smem, v, (j + NS - 1) * BN, Skv, v_off + ((j + NS - 1) % NS) * BN * DV,
                      b, g, tx, n_v_loads, CHV, SWV)
        T.ptx["cp.async.commit_group"]()
        T.ptx["cp.async.wait_group"](NS - 1)
        T.tvm_storage_sync("shared")
        kbase: T.let[T.int32] = k_off + (j % NS) * BN * D
        vbase: T.let[T.int32] = v_off + (j % NS) * BN * DV
        # S = Q·Kᵀ
        for i in T.unroll(MT * NN * 4):
            s_acc[i] = T.float32(0)
        for kk in T.unroll(KD):
            for nt2 in T.unroll(NN // 2):
                # x4: (n 0-7, k lo), (n 0-7, k hi), (n 8-15, k lo), (n 8-15, k hi)
                T.ptx["ldmatrix.sync.aligned.m8n8.x4.shared.b16"](
                    kb_frag[0], kb_frag[1], kb_frag[2], kb_frag[3],
                    T.cuda.cvta_generic_to_shared(T.address_of(smem[
                        kbase + (nt2 * 16 + (lane // 16) * 8 + lane % 8) * D
                        + T.bitwise_xor(kk * 2 + (lane // 8) % 2, (lane % 8) // SW) * 8])))
                for mt in T.unroll(MT):
                    for half in T.unroll(2):
                        T.ptx[mma_op](
                            s_acc[(mt * NN + nt2 * 2 + half) * 4 + 0],
                            s_acc[(mt * NN + nt2 * 2 + half) * 4 + 1],
                            s_acc[(mt * NN + nt2 * 2 + half) * 4 + 2],
                            s_acc[(mt * NN + nt2 * 2 + half) * 4 + 3],
                            q_frag[(mt * KD + kk) * 4 + 0], q_frag[(mt * KD + kk) * 4 + 1],
                            q_frag[(mt * KD + kk) * 4 + 2], q_frag[(mt * KD + kk) * 4 + 3],
                            kb_frag[half * 2 + 0], kb_frag[half * 2 + 1],
                            s_acc[(mt * NN + nt2 * 2 + half) * 4 + 0],
                            s_acc[(mt * NN + nt2 * 2 + half) * 4 + 1],
                            s_acc[(mt * NN + nt2 * 2 + half) * 4 + 2],
                            s_acc[(mt * NN + nt2 * 2 + half) * 4 + 3])
        # (soft cap,) scale, bias, mask
        for mt in T.unroll(MT):
            for nt in T.unroll(NN):
                for e in T.unroll(4):
                    row: T.let[T.int32] = (m0 + warp * MT * 16 + mt * 16 + lane // 4
                                           + (e // 2) * 8)
                    col: T.let[T.int32] = j * BN + nt * 8 + (lane % 4) * 2 + e % 2
                    si: T.let[T.int32] = (mt * NN + nt) * 4 + e
                    if cap_in is not None:  # soft cap: t = tanh(scale · q·k / c), one MUFU.TANH
                        T.ptx["tanh.approx.f32"](s_acc[si], s_acc[si] * T.float32(cap_in))
                    if has_bias:
                        s_acc[si] = s_acc[si] * sc + T.Cast("float32", bias[
                            b * fb, h * fh, T.min(row, Sq - 1) * fi, T.min(col, Skv - 1)]) * l2e
                    if mask:
                        if masked(spec, row, col):
                            s_acc[si] = T.float32(_NEG_INF)
        # online softmax: each thread holds 2 rows per m tile (lane/4 and lane/4 + 8)
        for mt in T.unroll(MT):
            for rh in T.unroll(2):
                ri: T.let[T.int32] = mt * 2 + rh
                st[0] = m_i[ri]
                for nt in T.unroll(NN):
                    st[0] = T.max(st[0], T.max(s_acc[(mt * NN + nt) * 4 + rh * 2],
                                               s_acc[(mt * NN + nt) * 4 + rh * 2 + 1]) * s_mul)
                st[0] = T.max(st[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[0], 1, 32, 32))
                st[0] = T.max(st[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[0], 2, 32, 32))
                # m' = −inf: nothing visible yet; subtract 0 so exp2(−inf) = 0, not NaN
                st[1] = T.if_then_else(st[0] == T.float32(_NEG_INF), T.float32(0), st[0])
                st[2] = T.exp2(m_i[ri] - st[1])
                m_i[ri] = st[0]
                l_i[ri] = l_i[ri] * st[2]
                for dn in T.unroll(ND):
                    for e in T.unroll(2):
                        o_acc[(mt * ND + dn) * 4 + rh * 2 + e] = (
                            o_acc[(mt * ND + dn) * 4 + rh * 2 + e] * st[2])
                for nt in T.unroll(NN):
                    for e in T.unroll(2):
                        T.ptx["ex2.approx.ftz.f32"](  # one MUFU.EX2; 2^−inf = +0
                            s_acc[(mt * NN + nt) * 4 + rh * 2 + e],
                            s_acc[(mt * NN + nt) * 4 + rh * 2 + e] * s_mul - st[1])
                        l_i[ri] = l_i[ri] + s_acc[(mt * NN + nt) * 4 + rh * 2 + e]
        # P as the A operand: k16 step kt = S n-tiles 2kt (a0, a1) and 2kt+1 (a2, a3)
        for mt in T.unroll(MT):
            for kt in T.unroll(KN):
                for a in T.unroll(4):
                    T.ptx[cvt_op](
                        p_frag[(mt * KN + kt) * 4 + a],
                        s_acc[(mt * NN + kt * 2 + a // 2) * 4 + (a % 2) * 2 + 1],
                        s_acc[(mt * NN + kt * 2 + a // 2) * 4 + (a % 2) * 2])
        # O += P·V   (V row-major [key][d] → B operand via ldmatrix.trans)
        for kt in T.unroll(KN):
            for dn2 in T.unroll(ND // 2):
                # x4.trans: (k lo, d 0-7), (k hi, d 0-7), (k lo, d 8-15), (k hi, d 8-15)
                T.ptx["ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"](
                    kb_frag[0], kb_frag[1], kb_frag[2], kb_frag[3],
                    T.cuda.cvta_generic_to_shared(T.address_of(smem[
                        vbase + (kt * 16 + ((lane // 8) % 2) * 8 + lane % 8) * DV
                        + T.bitwise_xor(dn2 * 2 + lane // 16, (lane % 8) // SWV) * 8])))
                for mt in T.unroll(MT):
                    for half in T.unroll(2):
                        T.ptx[mma_op](
                            o_acc[(mt * ND + dn2 * 2 + half) * 4 + 0],
                            o_acc[(mt * ND + dn2 * 2 + half) * 4 + 1],
                            o_acc[(mt * ND + dn2 * 2 + half) * 4 + 2],
                            o_acc[(mt * ND + dn2 * 2 + half) * 4 + 3],
                            p_frag[(mt * KN + kt) * 4 + 0], p_frag[(mt * KN + kt) * 4 + 1],
                            p_frag[(mt * KN + kt) * 4 + 2], p_frag[(mt * KN + kt) * 4 + 3],
                            kb_frag[half * 2 + 0], kb_frag[half * 2 + 1],
                            o_acc[(mt * ND + dn2 * 2 + half) * 4 + 0],
                            o_acc[(mt * ND + dn2 * 2 + half) * 4 + 1],
                            o_acc[(mt * ND + dn2 * 2 + half) * 4 + 2],
                            o_acc[(mt * ND + dn2 * 2 + half) * 4 + 3])

    def n_end_of(m0):
        # KV tiles that hold a key visible to some row of the tile starting at m0
        return tile_end(spec, T.min(m0 + BM, Sq) - 1, BN)

    def band_of(m0, n_end):
        # KV tiles [n_start, n_end) hold a key visible to some row of the tile, [n_lo, n_full)
        # only keys visible to every row (no mask); see spec.band_tiles
        return band_tiles(spec, m0, T.min(m0 + BM, Sq) - 1, BN, n_end)

    def stage(t):
        # ring stage of the prologue's tile t = n_start + p (without a window t = p < NS − 1)
        return t if spec.window is None else t % NS

    @T.macro
    def body(q, k, v, bias, out):
        bx = T.launch_thread("blockIdx.x", n_m)
        h = T.launch_thread("blockIdx.y", Hq)
        b = T.launch_thread("blockIdx.z", B)
        tx = T.launch_thread("threadIdx.x", NT)
        smem = T.alloc_buffer((smem_elems,), dt, scope="shared.dyn")
        s_acc = T.alloc_buffer((MT * NN * 4,), "float32", scope="local")
        o_acc = T.alloc_buffer((MT * ND * 4,), "float32", scope="local")
        q_frag = T.alloc_buffer((MT * KD * 4,), "uint32", scope="local")
        kb_frag = T.alloc_buffer((4,), "uint32", scope="local")
        p_frag = T.alloc_buffer((MT * KN * 4,), "uint32", scope="local")
        m_i = T.alloc_buffer((MT * 2,), "float32", scope="local")
        l_i = T.alloc_buffer((MT * 2,), "float32", scope="local")
        st = T.alloc_buffer((4,), "float32", scope="local")
        warp: T.let[T.int32] = tx // 32
        lane: T.let[T.int32] = tx % 32
        g: T.let[T.int32] = h // G
        m0: T.let[T.int32] = (r_base + r_sign * bx) * BM
        n_end: T.let[T.int32] = n_end_of(m0)
        if spec.window is None:  # every tile from 0 (Python 0s: nothing emitted)
            n_start = T.meta_var(0)
            n_lo = T.meta_var(0)
            n_full: T.let[T.int32] = T.min(full_tiles(spec, m0, BN), n_end)
        else:
            n_start: T.let[T.int32] = band_of(m0, n_end)[0]
            n_lo: T.let[T.int32] = band_of(m0, n_end)[1]
            n_full: T.let[T.int32] = band_of(m0, n_end)[2]
        # prologue: Q and KV tiles n_start .. n_start + NS−2 in flight (stage = tile % NS)
        load_tile(smem, q, m0, Sq, q_off, b, h, tx, n_q_loads, CH, SW)
        for p in T.unroll(NS - 1):
            if n_start + p < n_end:
                load_tile(smem, k, (n_start + p) * BN, Skv, k_off + stage(n_start + p) * BN * D,
                          b, g, tx, n_kv_loads, CH, SW)
                load_tile(smem, v, (n_start + p) * BN, Skv, v_off + stage(n_start + p) * BN * DV,
                          b, g, tx, n_v_loads, CHV, SWV)
            T.ptx["cp.async.commit_group"]()
        T.ptx["cp.async.wait_group"](NS - 2)
        T.tvm_storage_sync("shared")
        for mt in T.unroll(MT):
            for kk in T.unroll(KD):
                # x4: (rows 0-7, k lo), (rows 8-15, k lo), (rows 0-7, k hi), (rows 8-15, k hi)
                T.ptx["ldmatrix.sync.aligned.m8n8.x4.shared.b16"](
                    q_frag[(mt * KD + kk) * 4 + 0], q_frag[(mt * KD + kk) * 4 + 1],
                    q_frag[(mt * KD + kk) * 4 + 2], q_frag[(mt * KD + kk) * 4 + 3],
                    T.cuda.cvta_generic_to_shared(T.address_of(smem[
                        q_off + (warp * MT * 16 + mt * 16 + ((lane // 8) % 2) * 8 + lane % 8) * D
                        + T.bitwise_xor(kk * 2 + lane // 16, (lane % 8) // SW) * 8])))
        for i in T.unroll(MT * ND * 4):
            o_acc[i] = T.float32(0)
        for i in T.unroll(MT * 2):
            m_i[i] = T.float32(_NEG_INF)
            l_i[i] = T.float32(0)
        if spec.window is not None:  # the band's left edge: masked
            for j in T.serial(n_lo - n_start):
                kv_step(j + n_start, True, smem, k, v, bias, s_acc, o_acc, q_frag, kb_frag, p_frag,
                        m_i, l_i, st, b, h, g, m0, n_end, warp, lane, tx)
        for j in T.serial(n_full - n_lo):
            kv_step(j + n_lo, False, smem, k, v, bias, s_acc, o_acc, q_frag, kb_frag, p_frag, m_i,
                    l_i, st, b, h, g, m0, n_end, warp, lane, tx)
        for j in T.serial(n_end - n_full):
            kv_step(j + n_full, True, smem, k, v, bias, s_acc, o_acc, q_frag, kb_frag, p_frag,
                    m_i, l_i, st, b, h, g, m0, n_end, warp, lane, tx)
        # out = O / l   (l summed over the 4 lanes of a row's quad)
        for mt in T.unroll(MT):
            for rh in T.unroll(2):
                ri: T.let[T.int32] = mt * 2 + rh
                st[0] = l_i[ri]
                st[0] = st[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[0], 1, 32, 32)
                st[0] = st[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[0], 2, 32, 32)
                st[1] = T.if_then_else(st[0] > T.float32(0), T.float32(1) / st[0], T.float32(0))
                row: T.let[T.int32] = m0 + warp * MT * 16 + mt * 16 + lane // 4 + rh * 8
                if row < Sq:
                    for dn in T.unroll(ND):
                        for e in T.unroll(2):
                            out[at(OUT_L, b, row, h, dn * 8 + (lane % 4) * 2 + e)] = T.Cast(
                                odt, o_acc[(mt * ND + dn) * 4 + rh * 2 + e] * st[1])

    if has_bias:

        @T.prim_func
        def flash_attention(q: T.Buffer(q_shape, dt), k: T.Buffer(kv_shape, dt),
                            v: T.Buffer(v_shape, dt), bias: T.Buffer(bias_shape, bdt),
                            out: T.Buffer(out_shape, odt)):
            T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
            body(q, k, v, bias, out)

    else:

        @T.prim_func
        def flash_attention(q: T.Buffer(q_shape, dt), k: T.Buffer(kv_shape, dt),
                            v: T.Buffer(v_shape, dt), out: T.Buffer(out_shape, odt)):
            T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
            body(q, k, v, q, out)

    return flash_attention
