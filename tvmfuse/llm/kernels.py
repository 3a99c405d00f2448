"""TIR kernels of the derived KV cache: in-place append and attention over the cache.

Shapes (static per entry point; ``M`` = max_seq_len, ``Bm`` = max_batch)::

    state              (Bm, R, D)           one per attention layer, written in place:
                                            R = 2·Hkv·M + Hq rows (:func:`state_rows`)
    k, v               (Bm, S, Hkv, D)      this call's keys/values (BSHD, after RoPE)
    q, out             (Bm, S, Hq, D)
    offsets, starts    (Bm,) int32          slot of this call's first token; first real slot

    K[b, g, j] = state[b, g·M + j]      V[b, g, j] = state[b, Hkv·M + g·M + j]
    Q[b, h]    = state[b, 2·Hkv·M + h]  (decode: this step's query, written by the append)

    prefill append:  K[b, g, offsets[b] + s] = k[b, s, g]   (then V; slots < M only)
    decode append:   x = concat(q, k, v) over heads (Bm, 1, Hq + 2·Hkv, D):
                     Q[b, h] = x[b, 0, h];  K / V[b, g, offsets[b]] = x[b, 0, Hq (+Hkv) + g]
    attention:       out[b, 0, h] = Σ_j softmax_j(scale · Q[b,h]·K[b,g,j]) · V[b,g,j]
                     over j in [lo, p], p = offsets[b], lo = min(starts[b], p), g = h // (Hq/Hkv)

One state per layer, so the decode append is one kernel with one in-place output (TVM 0.27's
FuseTIR fails on a fused call with two): FuseOps fuses the RoPE of q and of k and the V slice
into it, and the attention reads this step's q from the state. A lower bound: slots before
``starts[b]`` are never read (the runtime right-pads prompts and passes 0; a row past its
bound sees only itself, so no row is empty). The key loop runs over exactly the visible slots
(a data-dependent extent); m, l and acc are fp32 scratch of the row (online softmax). The llvm
variant parallelises over (b, h); on CUDA the split-KV flash-decoding kernel reads the state (a
fallback binds (b, h) to blocks/threads, one row a thread: correct, not fast).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from ..attrs import CACHE_ATTENTION_ATTR
from ..device_props import device_properties
from ..kernels.attention.flash_decode import check as decode_check
from ..kernels.attention.flash_decode import (
    flash_decode_cache_primfunc,
    state_rows,
    sync_shape,
)
from ..kernels.attention.flash_decode import pick_config as pick_decode_config
from ..kernels.attention.spec import AttentionSpec

_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class CacheSpec:
    """One attention layer against its cache at one entry point's static shapes."""

    batch: int  # Bm
    seq: int  # S of this entry point (1 for decode)
    q_heads: int
    kv_heads: int
    head_dim: int
    max_seq: int
    dtype: str  # q/k/v and cache dtype
    scale: float
    window: int | None = None  # sliding window: a query sees its last `window` keys (itself included)
    softcap: float | None = None  # logit soft-capping (AttentionSpec.softcap)

    @property
    def rows(self) -> tuple[int, int, int, int]:
        """(K row 0, V row 0, q row 0, R) of the state (:func:`state_rows`)."""
        return state_rows(self.kv_heads, self.max_seq, self.q_heads)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.rows[3], self.head_dim)

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        """K (or V) seen as (Bm, Hkv, M, D)."""
        return (self.batch, self.kv_heads, self.max_seq, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seq, self.kv_heads, self.head_dim)

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seq, self.q_heads, self.head_dim)

    def attention_spec(self) -> AttentionSpec:
        """The decode step's attention (one query) over the whole cache."""
        return AttentionSpec(self.batch, 1, self.max_seq, self.q_heads, self.kv_heads,
                             self.head_dim, self.dtype, self.scale, softcap=self.softcap)

    @property
    def sync_shape(self) -> tuple[int]:
        """CUDA decode's int32 counters (zero between calls; shared by the layers)."""
        return sync_shape(self.attention_spec())


def _opaque(func: tvm.tirx.PrimFunc, cuda: bool) -> tvm.tirx.PrimFunc:
    """FuseOps must keep these apart (pattern 8 = opaque); CUDA ones are already scheduled."""
    func = _pattern(func, 8)
    # CUDA: the schedule stage (rules/fallback.py) skips it
    return func.with_attr("tirx.is_scheduled", True) if cuda else func


def kv_append(spec: CacheSpec, region: int, cuda: bool = False) -> tvm.tirx.PrimFunc:
    """``(state, x, offsets)``, prefill: this call's keys (``region`` 0) or values (1) ``x``
    (Bm, S, Hkv, D) into their rows of ``state``, in place (module doc); opaque: as injective,
    the read-back of this call's keys (and their pack for the flash kernel) would fuse into the
    kernel that writes them. CUDA: :func:`_append_vectorized` (the generic rule wrote one 2-byte
    element a thread: the data-dependent slot defeats its vectoriser)."""
    Bm, S, Hkv, D, M = spec.batch, spec.seq, spec.kv_heads, spec.head_dim, spec.max_seq
    vec = 16 // (tvm.DataType(spec.dtype).bits // 8)
    row0 = spec.rows[region]
    if cuda and D % vec == 0:
        return _opaque(_append_vectorized(spec, vec, row0), cuda)
    i64 = [T.int64(x) for x in (Bm, S, Hkv, D)]
    sshape = tuple(T.int64(x) for x in spec.state_shape)
    dt = spec.dtype

    @T.prim_func(s_tir=True)
    def append(state: T.Buffer(sshape, dt), x: T.Buffer(i64, dt), offsets: T.Buffer((i64[0],), "int32")):
        for b, s, g, d in T.grid(*i64):
            with T.sblock("append"):
                vb, vs, vg, vd = T.axis.remap("SSSS", [b, s, g, d])
                T.reads(x[vb, vs, vg, vd], offsets[vb])
                T.writes(state[vb, row0:row0 + Hkv * M, vd])
                if T.Cast("int64", offsets[vb]) + vs < M:
                    state[vb, row0 + vg * M + T.Cast("int64", offsets[vb]) + vs, vd] = x[vb, vs, vg, vd]

    return _opaque(append, cuda)


def decode_append(spec: CacheSpec) -> tvm.tirx.PrimFunc:
    """``(state, x, offsets)``, decode (S = 1): x = concat(q, k, v) over heads (Bm, 1, Hq + 2·Hkv,
    D) → this step's query rows, key and value slots ``offsets[b]`` (< M only) of ``state``, in
    place (module doc). Injective (plain TIR, scheduled by the GPU rules like any fused kernel):
    FuseOps fuses the RoPE of q and k and the V slice into it, one kernel a layer."""
    Bm, Hq, Hkv, D, M = spec.batch, spec.q_heads, spec.kv_heads, spec.head_dim, spec.max_seq
    if spec.seq != 1:
        raise ValueError(f"decode_append: one token per sequence, not S = {spec.seq}")
    k0, v0, q0, _ = spec.rows
    H = Hq + 2 * Hkv
    i64 = [T.int64(x) for x in (Bm, 1, H, D)]
    sshape = tuple(T.int64(x) for x in spec.state_shape)
    dt = spec.dtype

    @T.prim_func(s_tir=True)
    def append(state: T.Buffer(sshape, dt), x: T.Buffer(i64, dt), offsets: T.Buffer((i64[0],), "int32")):
        for b, s, h, d in T.grid(*i64):
            with T.sblock("append"):
                vb, vs, vh, vd = T.axis.remap("SSSS", [b, s, h, d])
                T.reads(x[vb, vs, vh, vd], offsets[vb])
                T.writes(state[vb, 0:q0 + Hq, vd])
                if vh < Hq or T.Cast("int64", offsets[vb]) < M:
                    state[vb, T.if_then_else(
                        vh < Hq, q0 + vh, T.if_then_else(
                            vh < Hq + Hkv, k0 + (vh - Hq) * M, v0 + (vh - Hq - Hkv) * M)
                        + T.Cast("int64", offsets[vb])), vd] = x[vb, vs, vh, vd]

    return _pattern(append, 2)


def _append_vectorized(spec: CacheSpec, vec: int, row0: int) -> tvm.tirx.PrimFunc:
    """CUDA prefill append, 16 bytes a thread: thread t of the flat grid moves the ``vec``
    elements ``x[b, s, g, vec·j : vec·(j + 1)]`` (j = t mod D/vec, then g, s, b) to row
    ``row0 + g·M + offsets[b] + s`` of ``state[b]`` (dropped past the cache): coalesced reads of x
    and D·2-byte row writes."""
    Bm, S, Hkv, D, M = spec.batch, spec.seq, spec.kv_heads, spec.head_dim, spec.max_seq
    dt, lanes = spec.dtype, D // vec
    total = Bm * S * Hkv * lanes
    threads = 256
    blocks = (total + threads - 1) // threads
    R = spec.rows[3]

    @T.prim_func
    def append(state: T.Buffer((Bm, R, D), dt), x: T.Buffer((Bm, S, Hkv, D), dt),
               offsets: T.Buffer((Bm,), "int32")):
        T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
        with T.launch_thread("blockIdx.x", blocks) as bx:
            tx = T.launch_thread("threadIdx.x", threads)
            t: T.let[T.int32] = bx * threads + tx
            j: T.let[T.int32] = t % lanes
            g: T.let[T.int32] = t // lanes % Hkv
            s: T.let[T.int32] = t // (lanes * Hkv) % S
            b: T.let[T.int32] = t // (lanes * Hkv * S)
            if t < total and offsets[T.min(b, Bm - 1)] + s < M:
                state[b, row0 + g * M + offsets[b] + s, T.ramp(j * vec, 1, vec)] = x[
                    b, s, g, T.ramp(j * vec, 1, vec)]

    return append


def _pattern(func: tvm.tirx.PrimFunc, pattern: int) -> tvm.tirx.PrimFunc:
    """``func`` with its FuseOps pattern (AnnotateTIROpPattern would call the data-dependent store
    opaque): decode's append injective (2), the prefill's and the attention opaque (8)."""
    # named where it is added
    return func.without_attr("global_symbol").with_attrs({"op_pattern": pattern, "tir.noalias": True})


def _row_macro(spec: CacheSpec, scope: str):
    """Online softmax of one decode row (b, h) over its visible cache slots, all read from the
    state (module doc)."""
    D, M, G = spec.head_dim, spec.max_seq, spec.q_heads // spec.kv_heads
    k0, v0, q0, _ = spec.rows
    dt = spec.dtype
    attn = spec.attention_spec()  # the scale and soft cap as every attention kernel takes them
    sc = float(attn.score_unit * _LOG2E)
    cap_in = attn.tanh_scale
    w = spec.window or M  # no window: p − (M − 1) ≤ 0

    @T.macro
    def row(state, offsets, starts, out, b, h):
        with T.sblock("row"):
            T.reads()
            T.writes()
            acc = T.sblock_alloc_buffer((D,), "float32", scope=scope)
            st = T.sblock_alloc_buffer((4,), "float32", scope=scope)  # m, l, score, alpha
            g: T.let[T.int32] = h // G
            p: T.let[T.int32] = T.min(offsets[b], M - 1)
            # the sequence's first slot, or (sliding window w) the window's: slot = position
            lo: T.let[T.int32] = T.max(T.min(starts[b], p), p - (w - 1))
            st[0] = T.float32(-1e30)
            st[1] = T.float32(0)
            for d in T.serial(D):
                acc[d] = T.float32(0)
            for j in T.serial(lo, p + 1):
                st[2] = T.float32(0)
                for d in T.serial(D):
                    st[2] += T.Cast("float32", state[b, q0 + h, d]) * T.Cast(
                        "float32", state[b, k0 + g * M + j, d])
                if cap_in is not None:  # soft cap: tanh(scale · q·k / c) · c
                    st[2] = T.tanh(st[2] * T.float32(cap_in))
                st[2] = st[2] * sc
                st[3] = T.exp2(st[0] - T.max(st[0], st[2]))  # rescale of what was summed so far
                st[0] = T.max(st[0], st[2])
                st[2] = T.exp2(st[2] - st[0])
                st[1] = st[1] * st[3] + st[2]
                for d in T.serial(D):
                    acc[d] = acc[d] * st[3] + st[2] * T.Cast("float32", state[b, v0 + g * M + j, d])
            for d in T.serial(D):
                out[b, 0, h, d] = T.Cast(dt, acc[d] / st[1])

    return row


def cache_attention(spec: CacheSpec, cuda: bool = False, fused_combine: bool = False,
                    l2_prefetch: bool = False, preload: bool = False, cluster: bool = False,
                    threads: int = 0, heads: int = 0) -> tvm.tirx.PrimFunc:
    """``(state, offsets, starts, out)``: decode attention (S = 1) over the cache, this step's
    query from the state (module doc). CUDA takes ``sync`` (``spec.sync_shape`` int32, zero
    before the first call, left zero) before ``out``: the split-KV flash-decoding kernel reading
    the state in place, its combine a second kernel or (``fused_combine``) in the same launch
    (:func:`~tvmfuse.kernels.attention.flash_decode.flash_decode_cache_primfunc`);
    ``l2_prefetch`` (sm_90, kernels launched with PDL only): the partial kernel prefetches its
    cache rows into L2 and then waits for its predecessor itself; with ``preload`` as well, its
    first keys and values load into registers before that wait (``DecodeConfig.preload``);
    ``cluster`` (sm_90): the chunks of a head row combine inside a thread-block cluster, one
    launch (``DecodeConfig.cluster``); ``threads`` per block of the split-KV kernel (0: its
    ``pick_config`` rule); ``heads``: query heads a block takes (``DecodeConfig.heads``)."""
    Bm, Hq = spec.batch, spec.q_heads
    if spec.seq != 1:
        raise ValueError(f"cache_attention: one query per sequence (decode), not S = {spec.seq}")
    if cuda and decode_check(spec.attention_spec()) is None:
        attn = spec.attention_spec()
        config = pick_decode_config(attn, device_properties().sms, fused_combine, l2_prefetch,
                                    preload, cluster and not fused_combine, threads, heads)
        # the spec and config, for the pass that rebuilds it with the append inside
        meta = json.dumps({"spec": dataclasses.asdict(attn), "config": dataclasses.asdict(config)})
        return _opaque(flash_decode_cache_primfunc(attn, config=config), cuda).with_attr(
            CACHE_ATTENTION_ATTR, meta)
    sshape, qshape, dt = spec.state_shape, spec.q_shape, spec.dtype
    row = _row_macro(spec, "local" if cuda else "global")

    if cuda:  # a head_dim the split-KV kernel does not take: one row a thread

        @T.prim_func(s_tir=True)
        def attention(state: T.Buffer(sshape, dt), offsets: T.Buffer((Bm,), "int32"),
                      starts: T.Buffer((Bm,), "int32"), sync: T.Buffer(spec.sync_shape, "int32"),
                      out: T.Buffer(qshape, dt)):
            for b in T.thread_binding(Bm, thread="blockIdx.x"):
                for h in T.thread_binding(Hq, thread="threadIdx.x"):
                    row(state, offsets, starts, out, b, h)

        return _opaque(attention, cuda)

    @T.prim_func(s_tir=True)
    def attention(state: T.Buffer(sshape, dt), offsets: T.Buffer((Bm,), "int32"),
                  starts: T.Buffer((Bm,), "int32"), out: T.Buffer(qshape, dt)):
        for b in T.parallel(Bm):
            for h in T.serial(Hq):
                row(state, offsets, starts, out, b, h)

    return _opaque(attention, cuda)
