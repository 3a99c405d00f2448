"""FlashAttention prefill kernel for sm_90a (FA3-style): TMA → mbarrier ring → wgmma, TIRx text.

One CTA per (query tile of ``BM = 64·consumers`` rows, query head, batch), ``1 + consumers``
warpgroups (warp specialisation)::

    warpgroup 0 (producer, one thread)   Q tile once, then K_j, V_j per KV tile by TMA (4-D tensor
                                         maps over (D, H, S, B), 128-byte swizzle, OOB rows = 0)
                                         into an NS-stage ring guarded by full/empty mbarriers
    warpgroup w ≥ 1 (consumer, 64 rows) for each KV tile j (causal: diagonal tiles first, tiles
                                         right of the diagonal skipped):
        S  = Q·K_jᵀ                      wgmma m64n{BN}k16, A and B from shared (SS), fp32
        S  masked (−inf) on diagonal / ragged tiles only
        m' = max(m, rowmax S·c);  α = 2^(m − m');  P = 2^(S·c − m');  l = α·l + rowsum P
                                         (c = scale·log2e folded into one FFMA)
        O  = α·O + P·V_j                 wgmma m64n{D}k16, A = P from registers (RS), B = V
                                         read MN-major from shared (trans-b)
    out = O / l (rows that see no key: 0), stored from registers, rows ≥ Sq masked.

S and P stay in registers. The kernel is TIRx text parsed by TVMScript and tagged
``tvmfuse.tirx`` so :func:`.gemm_sm90.uses_tirx` sends the build through the hybrid pipeline.
Covers fp16 / bf16, head dim 64 / 128, causal kinds, GQA / MQA, any Sq / Skv (D·2 bytes is a
multiple of 16, so TMA strides are legal). Not covered (the caller falls back to the sm80-style
kernel, see :func:`unsupported`): an additive bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm

from ..attrs import RULE_ATTR, SPEC_ATTR, TIRX_ATTR
from .attention_cpu import causal_offset
from .attention_spec import AttentionSpec, spec_json

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
    """Q tile + ``stages`` × (K tile + V tile), 2-byte elements."""
    return 2 * spec.head_dim * (cfg.block_m + 2 * cfg.stages * cfg.block_n)


def unsupported(spec: AttentionSpec, cfg: Sm90FlashConfig | None = None) -> str | None:
    """Why this kernel cannot compute ``spec`` (the caller falls back), or None."""
    cfg = cfg or default_config(spec)
    if spec.dtype not in _PTX_TYPE:
        return f"dtype {spec.dtype} unsupported (float16 or bfloat16)"
    if spec.result_dtype not in _PTX_TYPE and spec.result_dtype != "float32":
        return f"output dtype {spec.result_dtype} unsupported"
    if spec.head_dim not in (64, 128):
        return f"head_dim {spec.head_dim} unsupported (64 or 128)"
    if spec.bias_shape is not None:
        return "additive bias not implemented in the sm90a kernel"
    if not spec.scale > 0:
        return f"scale must be positive, not {spec.scale}"
    if cfg.block_n % 64 or not 64 <= cfg.block_n <= 256 or cfg.consumers not in (1, 2, 3):
        return f"tile {cfg} unsupported"
    if smem_bytes(spec, cfg) > 227 * 1024:
        return f"{smem_bytes(spec, cfg)} bytes of shared memory exceed 227 KiB"
    n_elems = spec.batch * max(spec.q_len, spec.kv_len) * spec.q_heads * spec.head_dim
    if n_elems >= 2**31:
        return "tensor beyond int32 indexing"
    return None


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def kernel_text(spec: AttentionSpec, cfg: Sm90FlashConfig, func_name: str = "main") -> str:
    """TVMScript (tirx) source of the kernel ``func_name(q, k, v, out)``."""
    B, Sq, Skv, Hq, Hkv, D = (spec.batch, spec.q_len, spec.kv_len, spec.q_heads, spec.kv_heads,
                              spec.head_dim)
    G = spec.group
    e, odt = spec.dtype, spec.result_dtype
    ab = _PTX_TYPE[e]
    BM, BN, NS, NC = cfg.block_m, cfg.block_n, cfg.stages, cfg.consumers
    DC = D // 64  # 64-element (128-byte) chunks per row: one TMA box / swizzle atom column each
    n_m, n_kv = _cdiv(Sq, BM), _cdiv(Skv, BN)
    off = causal_offset(spec)
    causal = off is not None
    off = off or 0
    c_log2 = float(spec.scale * _LOG2E)
    # shared layout (elements): Q [DC][BM][64] | K [NS][DC][BN][64] | V [NS][DC][BN][64]
    q_chunk, kv_chunk = BM * 64, BN * 64
    kv_tile = DC * kv_chunk
    k_off = DC * q_chunk
    v_off = k_off + NS * kv_tile
    total = v_off + NS * kv_tile
    q_bytes, kv_bytes = BM * D * 2, BN * D * 2
    s_n, o_n = BN // 2, D // 2  # fp32 accumulators per consumer thread (64 × N / 128)
    mma_s = f'T.ptx["wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.{ab}.{ab}"]'
    mma_o = f'T.ptx["wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab}"]'
    tma = 'T.ptx["cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"]'
    cvt = f'T.ptx["cvt.rn.{ab}x2.f32"]'
    tma_st = 'T.ptx["cp.async.bulk.tensor.4d.global.shared::cta.bulk_group"]'
    smem = "T.cuda.cvta_generic_to_shared"

    lines: list[str] = []

    def w(indent: int, text: str) -> None:
        lines.append("    " * indent + text)

    w(0, "@T.prim_func")
    w(0, f"def {func_name}(q_h: T.handle, k_h: T.handle, v_h: T.handle, o_h: T.handle):")
    w(1, 'T.func_attr({"tirx.noalias": True})')
    w(1, f'q = T.match_buffer(q_h, ({B}, {Sq}, {Hq}, {D}), "{e}", align=16)')
    w(1, f'k = T.match_buffer(k_h, ({B}, {Skv}, {Hkv}, {D}), "{e}", align=16)')
    w(1, f'v = T.match_buffer(v_h, ({B}, {Skv}, {Hkv}, {D}), "{e}", align=16)')
    w(1, f'out = T.match_buffer(o_h, ({B}, {Sq}, {Hq}, {D}), "{odt}", align=16)')
    # host: 4-D tensor maps, dims innermost first (D, H, S, B), byte strides of H, S, B,
    # box (64, 1, rows, 1), element strides 1, no interleave, 128B swizzle, L2 256B, OOB zeros
    tma_store = cfg.tma_store and odt == e
    maps = [("Q", "q", Hq, Sq, BM), ("K", "k", Hkv, Skv, BN), ("V", "v", Hkv, Skv, BN)]
    if tma_store:
        maps.append(("O", "out", Hq, Sq, 64))
    for name, buf, heads, seq, rows in maps:
        w(1, f'{name}_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)')
        w(1, f'T.call_packed("runtime.cuTensorMapEncodeTiled", {name}_map, "{e}", 4, {buf}.data, '
             f"{D}, {heads}, {seq}, {B}, {D * 2}, {heads * D * 2}, {seq * heads * D * 2}, "
             f"64, 1, {rows}, 1, 1, 1, 1, 1, 0, {SW128}, 2, 0)")
    w(1, "T.device_entry()")
    w(1, f"bid = T.cta_id([{n_m * Hq * B}])")
    w(1, f"tx = T.thread_id([{cfg.threads}])")
    w(1, f'smem = T.alloc_buffer(({total},), "{e}", scope="shared.dyn", align=1024)')
    if tma_store:
        w(1, f'smem32 = T.decl_buffer(({total // 2},), "uint32", data=smem.data, scope="shared.dyn")')
    w(1, 'q_full = T.alloc_shared([1], "uint64")')
    for bar in ("k_full", "k_empty", "v_full", "v_empty"):
        w(1, f'{bar} = T.alloc_shared([{NS}], "uint64")')
    # causal: the longest query tiles first; the heads and batches of one tile run side by side
    tile = f"({n_m - 1} - bid // {Hq * B})" if causal else f"(bid // {Hq * B})"
    w(1, f"m0 = {tile} * {BM}")
    w(1, f"b = (bid % {Hq * B}) // {Hq}")
    w(1, f"h = bid % {Hq}")
    w(1, f"g = h // {G}")
    if causal:
        # KV tiles holding a key visible to some row (n_end) / to every row (n_full) of the tile
        w(1, f"n_end = T.max(T.min({n_kv}, (T.min(m0 + {BM}, {Sq}) - 1 + {off}) // {BN} + 1), 0)")
        w(1, f"n_full = T.min(T.max(T.min({Skv // BN}, (m0 + {off} + 1) // {BN}), 0), n_end)")
    else:
        w(1, f"n_end = {n_kv}")
        w(1, f"n_full = {Skv // BN}")
    w(1, "n_mask = n_end - n_full")
    w(1, "if tx == 0:")
    w(2, f"T.ptx.mbarrier.init.shared.b64({smem}(q_full.ptr_to([0])), T.uint32(1))")
    w(2, f"for s in T.unroll({NS}):")
    for bar, count in (("k_full", 1), ("v_full", 1), ("k_empty", NC * WG), ("v_empty", NC * WG)):
        w(3, f"T.ptx.mbarrier.init.shared.b64({smem}({bar}.ptr_to([s])), T.uint32({count}))")
    w(1, "T.ptx.fence.mbarrier_init.release.cluster()")
    w(1, "T.cuda.cta_sync()")
    w(1, "if tx // 128 == 0:")
    w(2, f'T.ptx["setmaxnreg.dec.sync.aligned.u32"]({cfg.producer_regs})')
    w(2, "if tx == 0:")
    w(3, f"T.ptx.mbarrier.arrive.expect_tx.shared.b64({smem}(q_full.ptr_to([0])), "
         f"T.uint32({q_bytes}))")
    for c in range(DC):
        w(3, f"{tma}({smem}(smem.ptr_to([{c * q_chunk}])), T.address_of(Q_map), "
             f"{c * 64}, h, m0, b, {smem}(q_full.ptr_to([0])))")
    # KV tiles in processing order: jj-th tile is j = n_end − 1 − jj (masked tiles first)
    w(3, "for jj in T.serial(n_end):")
    w(4, f"s = jj % {NS}")
    w(4, "j = n_end - 1 - jj")
    for name, full, empty, base in (("K", "k_full", "k_empty", k_off),
                                    ("V", "v_full", "v_empty", v_off)):
        w(4, f"if jj >= {NS}:")
        w(5, f"T.cuda.mbarrier_wait({empty}.ptr_to([s]), (jj // {NS} + 1) % 2)")
        w(4, f"T.ptx.mbarrier.arrive.expect_tx.shared.b64({smem}({full}.ptr_to([s])), "
             f"T.uint32({kv_bytes}))")
        for c in range(DC):
            w(4, f"{tma}({smem}(smem.ptr_to([{base} + s * {kv_tile} + {c * kv_chunk}])), "
                 f"T.address_of({name}_map), {c * 64}, g, j * {BN}, b, "
                 f"{smem}({full}.ptr_to([s])))")
    w(1, "else:")
    w(2, f'T.ptx["setmaxnreg.inc.sync.aligned.u32"]({cfg.consumer_regs})')
    w(2, f's_acc = T.alloc_buffer(({s_n},), "float32", scope="local")')
    w(2, f'o_acc = T.alloc_buffer(({o_n},), "float32", scope="local")')
    w(2, f'p_frag = T.alloc_buffer(({BN // 4},), "uint32", scope="local")')
    w(2, 'm_i = T.alloc_buffer((2,), "float32", scope="local")')
    w(2, 'l_i = T.alloc_buffer((2,), "float32", scope="local")')
    w(2, 'st = T.alloc_buffer((4,), "float32", scope="local")')
    w(2, 'alpha = T.alloc_buffer((2,), "float32", scope="local")')
    w(2, 'desc_q = T.alloc_buffer((1,), "uint64", scope="local")')
    w(2, 'desc_k = T.alloc_buffer((1,), "uint64", scope="local")')
    w(2, 'desc_v = T.alloc_buffer((1,), "uint64", scope="local")')
    w(2, "wg = tx // 128 - 1")
    w(2, "t = tx % 128")
    w(2, "row0 = m0 + wg * 64 + (t // 32) * 16 + (t % 32) // 4")
    w(2, "col0 = (t % 4) * 2")
    # descriptors: K-major 128B-swizzled Q / K (LBO unused, SBO 1024 B between 8-row groups);
    # V MN-major (LBO = one 64-column chunk of BN rows, SBO 1024 B)
    w(2, f"T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_q[0]), "
         f"smem.ptr_to([wg * {64 * 64}]), 1, 64, {SW128})")
    w(2, f"T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_k[0]), "
         f"smem.ptr_to([{k_off}]), 1, 64, {SW128})")
    w(2, f"T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_v[0]), "
         f"smem.ptr_to([{v_off}]), {kv_chunk * 2 // 16}, 64, {SW128})")
    w(2, f"for i in T.unroll({o_n}):")
    w(3, "o_acc[i] = T.float32(0)")
    w(2, "for i in T.unroll(2):")
    w(3, 'm_i[i] = T.float32("-inf")')
    w(3, "l_i[i] = T.float32(0)")
    w(2, "T.cuda.mbarrier_wait(q_full.ptr_to([0]), 0)")
    s_accs = ", ".join(f"s_acc[{i}]" for i in range(s_n))
    o_accs = ", ".join(f"o_acc[{i}]" for i in range(o_n))

    def issue_s(ind: int, stage: str) -> None:
        # S = Q·Kᵀ: k16 step kk reads 32 bytes into the 128-byte row of d-chunk kk // 4
        for kk in range(D // 16):
            a_off = ((kk // 4) * q_chunk * 2 + (kk % 4) * 32) // 16
            b_off = f"({stage} * {kv_tile * 2} + {(kk // 4) * kv_chunk * 2 + (kk % 4) * 32}) // 16"
            w(ind, f"{mma_s}({s_accs}, desc_q[0] + T.uint64({a_off}), "
                   f"desc_k[0] + T.uint64({b_off}), {kk > 0}, 1, 1, 0, 0)")
        w(ind, "T.ptx.wgmma.commit_group.sync.aligned()")

    def issue_pv(ind: int, stage: str) -> None:
        # O += P·V: k16 step kt = keys 16kt.. = 16 rows of 128 B in every d-chunk
        for kt in range(BN // 16):
            b_off = f"({stage} * {kv_tile * 2} + {kt * 16 * 128}) // 16"
            w(ind, f"{mma_o}({o_accs}, p_frag[{kt * 4}], p_frag[{kt * 4 + 1}], "
                   f"p_frag[{kt * 4 + 2}], p_frag[{kt * 4 + 3}], desc_v[0] + T.uint64({b_off}), "
                   "True, 1, 1, 1)")
        w(ind, "T.ptx.wgmma.commit_group.sync.aligned()")

    def mask(ind: int, jj: str = "jj", j: str = "j") -> None:
        # keys past Skv and (causal) right of the diagonal; only the first n_mask tiles
        w(ind, f"if {jj} < n_mask:")
        w(ind + 1, f"for jn in T.unroll({BN // 8}):")
        w(ind + 2, "for x in T.unroll(4):")
        w(ind + 3, f"col = {j} * {BN} + jn * 8 + col0 + x % 2")
        cond = f"col >= {Skv}"
        if causal:
            cond += f" or col > row0 + (x // 2) * 8 + {off}"
        w(ind + 3, f"if {cond}:")
        w(ind + 4, 's_acc[jn * 4 + x] = T.float32("-inf")')

    def softmax(ind: int, rescale_now: bool) -> None:
        # a thread holds rows row0 and row0 + 8; a row lives in a quad of lanes.
        # alpha[r] = 2^(m − m'); O is rescaled here or (overlap) once the P·V in flight retired
        w(ind, "for r in T.unroll(2):")
        w(ind + 1, "st[0] = m_i[r]")
        w(ind + 1, f"for jn in T.unroll({BN // 8}):")
        w(ind + 2, f"st[0] = T.max(st[0], T.max(s_acc[jn * 4 + r * 2], s_acc[jn * 4 + r * 2 + 1]) "
                   f"* T.float32({c_log2!r}))")
        for lane_mask in (1, 2):
            w(ind + 1, f"st[0] = T.max(st[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[0], "
                       f"{lane_mask}, 32, 32))")
        # m' = −inf: nothing visible yet; subtract 0 so 2^(−inf) = 0, not NaN
        w(ind + 1, 'st[1] = T.if_then_else(st[0] == T.float32("-inf"), T.float32(0), st[0])')
        w(ind + 1, "alpha[r] = T.exp2(m_i[r] - st[1])")
        w(ind + 1, "m_i[r] = st[0]")
        w(ind + 1, "l_i[r] = l_i[r] * alpha[r]")
        w(ind + 1, f"for jn in T.unroll({BN // 8}):")
        w(ind + 2, "for x in T.unroll(2):")
        w(ind + 3, 'T.ptx["ex2.approx.ftz.f32"](s_acc[jn * 4 + r * 2 + x], '
                   f"s_acc[jn * 4 + r * 2 + x] * T.float32({c_log2!r}) - st[1])")
        w(ind + 3, "l_i[r] = l_i[r] + s_acc[jn * 4 + r * 2 + x]")
        if rescale_now:
            rescale(ind)

    def rescale(ind: int) -> None:
        w(ind, f"for dn in T.unroll({D // 8}):")
        w(ind + 1, "for x in T.unroll(4):")
        w(ind + 2, "o_acc[dn * 4 + x] = o_acc[dn * 4 + x] * alpha[x // 2]")

    def to_p(ind: int) -> None:
        # P → A fragments: register i packs accumulators 2i (low half) and 2i + 1 (high half)
        w(ind, f"for i in T.unroll({BN // 4}):")
        w(ind + 1, f"{cvt}(p_frag[i], s_acc[2 * i + 1], s_acc[2 * i])")

    def turn_wait(ind: int) -> None:
        # ping-pong: warpgroup wg issues its GEMMs only after the other one issued theirs
        if cfg.pingpong:
            w(ind, f"T.ptx['bar.sync'](T.uint32(1 + wg), T.uint32({2 * WG}))")

    def turn_pass(ind: int) -> None:
        if cfg.pingpong:
            w(ind, f"T.ptx['bar.arrive'](T.uint32(2 - wg), T.uint32({2 * WG}))")

    if cfg.pingpong:
        w(2, "if wg == 1:")  # warpgroup 0 goes first
        w(3, f"T.ptx['bar.arrive'](T.uint32(1), T.uint32({2 * WG}))")
    if not cfg.overlap:
        w(2, "for jj in T.serial(n_end):")
        w(3, f"s = jj % {NS}")
        w(3, f"ph = (jj // {NS}) % 2")
        w(3, "j = n_end - 1 - jj")
        w(3, "T.cuda.mbarrier_wait(k_full.ptr_to([s]), ph)")
        turn_wait(3)
        w(3, "T.ptx.wgmma.fence.sync.aligned()")
        issue_s(3, "s")
        turn_pass(3)
        w(3, "T.ptx.wgmma.wait_group.sync.aligned(0)")
        w(3, f"T.ptx.mbarrier.arrive.shared.b64({smem}(k_empty.ptr_to([s])))")
        mask(3)
        softmax(3, rescale_now=True)
        to_p(3)
        w(3, "T.cuda.mbarrier_wait(v_full.ptr_to([s]), ph)")
        w(3, "T.ptx.wgmma.fence.sync.aligned()")
        issue_pv(3, "s")
        w(3, "T.ptx.wgmma.wait_group.sync.aligned(0)")
        w(3, f"T.ptx.mbarrier.arrive.shared.b64({smem}(v_empty.ptr_to([s])))")
    else:
        # FA3 intra-warpgroup overlap: S_jj = Q·K_jjᵀ and O += P_{jj−1}·V_{jj−1} in flight
        # together; the softmax of S_jj runs while the P·V wgmma still executes
        w(2, "if n_end > 0:")
        w(3, "T.cuda.mbarrier_wait(k_full.ptr_to([0]), 0)")
        turn_wait(3)
        w(3, "T.ptx.wgmma.fence.sync.aligned()")
        issue_s(3, "0")
        turn_pass(3)
        w(3, "T.ptx.wgmma.wait_group.sync.aligned(0)")
        w(3, f"T.ptx.mbarrier.arrive.shared.b64({smem}(k_empty.ptr_to([0])))")
        mask(3, "0", "(n_end - 1)")
        softmax(3, rescale_now=False)
        to_p(3)
        w(2, "for jj in T.serial(1, n_end):")
        w(3, f"s = jj % {NS}")
        w(3, f"sp = (jj + {NS - 1}) % {NS}")
        w(3, "j = n_end - 1 - jj")
        w(3, f"T.cuda.mbarrier_wait(k_full.ptr_to([s]), (jj // {NS}) % 2)")
        w(3, f"T.cuda.mbarrier_wait(v_full.ptr_to([sp]), ((jj - 1) // {NS}) % 2)")
        turn_wait(3)
        w(3, "T.ptx.wgmma.fence.sync.aligned()")
        issue_s(3, "s")
        issue_pv(3, "sp")
        turn_pass(3)
        w(3, "T.ptx.wgmma.wait_group.sync.aligned(1)")
        w(3, f"T.ptx.mbarrier.arrive.shared.b64({smem}(k_empty.ptr_to([s])))")
        mask(3)
        softmax(3, rescale_now=False)
        w(3, "T.ptx.wgmma.wait_group.sync.aligned(0)")
        w(3, f"T.ptx.mbarrier.arrive.shared.b64({smem}(v_empty.ptr_to([sp])))")
        rescale(3)
        to_p(3)
        w(2, "if n_end > 0:")
        w(3, f"sl = (n_end - 1) % {NS}")
        w(3, f"T.cuda.mbarrier_wait(v_full.ptr_to([sl]), ((n_end - 1) // {NS}) % 2)")
        w(3, "T.ptx.wgmma.fence.sync.aligned()")
        issue_pv(3, "sl")
        w(3, "T.ptx.wgmma.wait_group.sync.aligned(0)")
        w(3, f"T.ptx.mbarrier.arrive.shared.b64({smem}(v_empty.ptr_to([sl])))")
    if cfg.pingpong:
        w(2, "if wg == 0:")  # consume warpgroup 1's last hand-over
        w(3, f"T.ptx['bar.sync'](T.uint32(1), T.uint32({2 * WG}))")
    # out = O / l   (l summed over the quad)
    w(2, "for r in T.unroll(2):")
    w(3, "st[0] = l_i[r]")
    for lane_mask in (1, 2):
        w(3, f"st[0] = st[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[0], "
             f"{lane_mask}, 32, 32)")
    w(3, "alpha[r] = T.if_then_else(st[0] > T.float32(0), T.float32(1) / st[0], T.float32(0))")
    if tma_store:
        # O tile → this warpgroup's (now idle) Q rows in the same 128B-swizzled layout, then
        # one TMA store per d-chunk (rows ≥ Sq are clipped by the tensor map)
        w(2, "row_l = (t // 32) * 16 + (t % 32) // 4")
        w(2, f"for dn in T.unroll({D // 8}):")
        w(3, "for r in T.unroll(2):")
        w(4, f"{cvt}(p_frag[0], o_acc[dn * 4 + r * 2 + 1] * alpha[r], "
             "o_acc[dn * 4 + r * 2] * alpha[r])")
        w(4, f"smem32[((dn // 8) * {q_chunk} + wg * {64 * 64} + (row_l + r * 8) * 64 + "
             "T.bitwise_xor(dn % 8, (row_l + r * 8) % 8) * 8 + col0) // 2] = p_frag[0]")
        w(2, 'T.ptx["fence.proxy.async.shared::cta"]()')
        w(2, f"T.ptx['bar.sync'](T.uint32(3 + wg), T.uint32({WG}))")
        w(2, "if t == 0:")
        for c in range(DC):
            w(3, f"{tma_st}(T.address_of(O_map), {c * 64}, h, m0 + wg * 64, b, "
                 f"{smem}(smem.ptr_to([{c * q_chunk} + wg * {64 * 64}])))")
        w(3, 'T.ptx["cp.async.bulk.commit_group"]()')
        w(3, 'T.ptx["cp.async.bulk.wait_group.read"](0)')
    else:
        w(2, "for r in T.unroll(2):")
        w(3, f"if row0 + r * 8 < {Sq}:")
        w(4, f"for dn in T.unroll({D // 8}):")
        w(5, "for x in T.unroll(2):")
        w(6, f'out[b, row0 + r * 8, h, dn * 8 + col0 + x] = T.Cast("{odt}", '
             "o_acc[dn * 4 + r * 2 + x] * alpha[r])")
    return "\n".join(lines) + "\n"


def flash_attention_sm90_primfunc(spec: AttentionSpec, target: tvm.target.Target | None = None,
                                  config: Sm90FlashConfig | None = None,
                                  name: str | None = None) -> tvm.tirx.PrimFunc:
    """PrimFunc ``(q, k, v, out)`` for ``spec`` on sm_90a; ValueError when not covered.

    ``name``: keep a global symbol (standalone builds); inside a Relax module the build names it.
    """
    from tvm.script import tirx as T
    from tvm.script.parser.core.entry import parse

    cfg = config or default_config(spec)
    reason = unsupported(spec, cfg)
    if reason:
        raise ValueError(f"flash attention sm90a: {reason}")
    func = parse(kernel_text(spec, cfg), extra_vars={"T": T})
    attrs = {"tirx.is_scheduled": True, "tir.is_scheduled": True, RULE_ATTR: NAME,
             TIRX_ATTR: True,
             "tvmfuse.tile": f"{cfg.block_m}x{cfg.block_n} stages={cfg.stages}",
             SPEC_ATTR: spec_json(spec)}  # tvmfuse tune regenerates the kernel from it
    func = func.with_attrs(attrs)
    return func.with_attr("global_symbol", name) if name else func.without_attr("global_symbol")
