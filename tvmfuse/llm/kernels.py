"""TIR kernels of the derived KV cache: in-place append and attention over the cache.

Shapes (static per entry point; ``M`` = max_seq_len, ``Bm`` = max_batch)::

    k_cache, v_cache   (Bm, Hkv, M, D)      one pair per attention layer, written in place
    k, v               (Bm, S, Hkv, D)      this call's keys/values (BSHD, after RoPE)
    q, out             (Bm, S, Hq, D)
    offsets, starts    (Bm,) int32          slot of this call's first token; first real slot

    append:     cache[b, g, offsets[b] + s, :] = k[b, s, g, :]            (slots < M only; k, v each)
    attention:  out[b, s, h] = Σ_j softmax_j(scale · q[b,s,h]·k_cache[b,g,j]) · v_cache[b,g,j]
                over j in [lo, p], p = offsets[b] + s, lo = min(starts[b], p), g = h // (Hq/Hkv)

A lower bound: slots before ``starts[b]`` are never read (the runtime right-pads prompts and
passes 0; a row past its bound sees only itself, so no row is empty). The key loop runs over
exactly the visible slots (a data-dependent extent); m, l and acc are fp32 scratch of the row
(online softmax). The llvm variant parallelises over (b, s, h); at decode (S = 1) CUDA runs the split-KV
flash-decoding kernel over the cache; CUDA prefill binds (b·S + s, h) to blocks and runs each row
in one thread: correct on the GPU, not fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from ..kernels.attention.flash_decode import check as decode_check
from ..kernels.attention.flash_decode import flash_decode_cache_primfunc, sync_shape
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

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
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
                             self.head_dim, self.dtype, self.scale)

    @property
    def sync_shape(self) -> tuple[int]:
        """CUDA decode's int32 counters (zero between calls; shared by the layers)."""
        return sync_shape(self.attention_spec())


def _opaque(func: tvm.tirx.PrimFunc, cuda: bool) -> tvm.tirx.PrimFunc:
    """FuseOps must keep these apart (pattern 8 = opaque); CUDA ones are already scheduled."""
    func = _pattern(func, 8)
    # CUDA: the schedule stage (rules/fallback.py) skips it
    return func.with_attr("tirx.is_scheduled", True) if cuda else func


def kv_append(spec: CacheSpec, fusable: bool = False, cuda: bool = False) -> tvm.tirx.PrimFunc:
    """``(cache, x, offsets)``: writes this call's keys (or values) ``x`` into ``cache`` in place
    (module doc); one call per cache.

    Plain (unscheduled) TIR, scheduled by the GPU rules like any fused kernel. ``fusable``
    (decode) marks it injective so FuseOps fuses the producers of x into it: the RoPE of k, or
    the V slice, and its append are one kernel (:func:`_pattern`). One cache per call: TVM
    0.27's FuseTIR fails on a fused call with two in-place outputs. A CUDA prefill's (not
    fusable) is :func:`_append_vectorized`: the generic rule wrote it one 2-byte element per
    thread (the data-dependent slot defeats its vectoriser)."""
    Bm, S, Hkv, D, M = spec.batch, spec.seq, spec.kv_heads, spec.head_dim, spec.max_seq
    vec = 16 // (tvm.DataType(spec.dtype).bits // 8)
    if cuda and not fusable and D % vec == 0:
        return _opaque(_append_vectorized(spec, vec), cuda)
    i64 = [T.int64(x) for x in (Bm, S, Hkv, D)]
    cshape = (i64[0], i64[2], T.int64(M), i64[3])
    dt = spec.dtype

    @T.prim_func(s_tir=True)
    def append(cache: T.Buffer(cshape, dt), x: T.Buffer(i64, dt), offsets: T.Buffer((i64[0],), "int32")):
        for b, s, g, d in T.grid(*i64):
            with T.sblock("append"):
                vb, vs, vg, vd = T.axis.remap("SSSS", [b, s, g, d])
                T.reads(x[vb, vs, vg, vd], offsets[vb])
                T.writes(cache[vb, vg, 0:M, vd])
                if T.Cast("int64", offsets[vb]) + vs < M:
                    cache[vb, vg, T.Cast("int64", offsets[vb]) + vs, vd] = x[vb, vs, vg, vd]

    return _pattern(append, 2 if fusable else 8)


def _append_vectorized(spec: CacheSpec, vec: int) -> tvm.tirx.PrimFunc:
    """CUDA append, 16 bytes a thread: thread t of the flat grid moves the ``vec`` elements
    ``x[b, s, g, vec·j : vec·(j + 1)]`` (j = t mod D/vec, then g, s, b) to row ``offsets[b] + s``
    of ``cache[b, g]`` (dropped past the cache): coalesced reads of x and D·2-byte row writes."""
    Bm, S, Hkv, D, M = spec.batch, spec.seq, spec.kv_heads, spec.head_dim, spec.max_seq
    dt, lanes = spec.dtype, D // vec
    total = Bm * S * Hkv * lanes
    threads = 256
    blocks = (total + threads - 1) // threads

    @T.prim_func
    def append(cache: T.Buffer((Bm, Hkv, M, D), dt), x: T.Buffer((Bm, S, Hkv, D), dt),
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
                cache[b, g, offsets[b] + s, T.ramp(j * vec, 1, vec)] = x[b, s, g, T.ramp(j * vec, 1, vec)]

    return append


def _pattern(func: tvm.tirx.PrimFunc, pattern: int) -> tvm.tirx.PrimFunc:
    """``func`` with its FuseOps pattern (AnnotateTIROpPattern would call the data-dependent store
    opaque). Decode's append is injective (2): the producers of k and v fuse into it, and its
    consumers are the opaque attention kernel. A prefill's is opaque (8): as injective, the
    read-back of this call's keys (and their pack for the flash kernel) would fuse into the
    kernel that writes them."""
    # named where it is added
    return func.without_attr("global_symbol").with_attrs({"op_pattern": pattern, "tir.noalias": True})


def _row_macro(spec: CacheSpec, scope: str):
    """Online softmax of one (b, s, h) row over its visible cache slots."""
    D, M, G = spec.head_dim, spec.max_seq, spec.q_heads // spec.kv_heads
    dt = spec.dtype
    sc = float(spec.scale * _LOG2E)

    @T.macro
    def row(q, kc, vc, offsets, starts, out, b, s, h):
        with T.sblock("row"):
            T.reads()
            T.writes()
            acc = T.sblock_alloc_buffer((D,), "float32", scope=scope)
            st = T.sblock_alloc_buffer((4,), "float32", scope=scope)  # m, l, score, alpha
            g: T.let[T.int32] = h // G
            p: T.let[T.int32] = T.min(offsets[b] + s, M - 1)
            lo: T.let[T.int32] = T.min(starts[b], p)
            st[0] = T.float32(-1e30)
            st[1] = T.float32(0)
            for d in T.serial(D):
                acc[d] = T.float32(0)
            for j in T.serial(lo, p + 1):
                st[2] = T.float32(0)
                for d in T.serial(D):
                    st[2] += T.Cast("float32", q[b, s, h, d]) * T.Cast("float32", kc[b, g, j, d])
                st[2] = st[2] * sc
                st[3] = T.exp2(st[0] - T.max(st[0], st[2]))  # rescale of what was summed so far
                st[0] = T.max(st[0], st[2])
                st[2] = T.exp2(st[2] - st[0])
                st[1] = st[1] * st[3] + st[2]
                for d in T.serial(D):
                    acc[d] = acc[d] * st[3] + st[2] * T.Cast("float32", vc[b, g, j, d])
            for d in T.serial(D):
                out[b, s, h, d] = T.Cast(dt, acc[d] / st[1])

    return row


def cache_attention(spec: CacheSpec, cuda: bool = False) -> tvm.tirx.PrimFunc:
    """``(q, k_cache, v_cache, offsets, starts, out)``: attention over the cache (module doc).

    CUDA decode (S = 1) takes ``sync`` (``spec.sync_shape`` int32, zero before the first call,
    left zero) before ``out``: the split-KV flash-decoding kernel reading the cache in place, its
    combine in the same launch
    (:func:`~tvmfuse.kernels.attention.flash_decode.flash_decode_cache_primfunc`)."""
    Bm, S, Hq = spec.batch, spec.seq, spec.q_heads
    if cuda and S == 1 and decode_check(spec.attention_spec()) is None:
        return _opaque(flash_decode_cache_primfunc(spec.attention_spec(), fused_combine=True), cuda)
    cshape, qshape, dt = spec.cache_shape, spec.q_shape, spec.dtype
    row = _row_macro(spec, "local" if cuda else "global")

    if cuda:

        @T.prim_func(s_tir=True)
        def attention(q: T.Buffer(qshape, dt), kc: T.Buffer(cshape, dt), vc: T.Buffer(cshape, dt),
                      offsets: T.Buffer((Bm,), "int32"), starts: T.Buffer((Bm,), "int32"),
                      out: T.Buffer(qshape, dt)):
            for bs in T.thread_binding(Bm * S, thread="blockIdx.x"):
                for h in T.thread_binding(Hq, thread="threadIdx.x"):
                    row(q, kc, vc, offsets, starts, out, bs // S, bs % S, h)

        if S == 1:  # the decode signature (sync unused)

            @T.prim_func(s_tir=True)
            def attention_sync(q: T.Buffer(qshape, dt), kc: T.Buffer(cshape, dt),
                               vc: T.Buffer(cshape, dt), offsets: T.Buffer((Bm,), "int32"),
                               starts: T.Buffer((Bm,), "int32"),
                               sync: T.Buffer(spec.sync_shape, "int32"), out: T.Buffer(qshape, dt)):
                for bs in T.thread_binding(Bm, thread="blockIdx.x"):
                    for h in T.thread_binding(Hq, thread="threadIdx.x"):
                        row(q, kc, vc, offsets, starts, out, bs, 0, h)

            return _opaque(attention_sync, cuda)
        return _opaque(attention, cuda)

    @T.prim_func(s_tir=True)
    def attention(q: T.Buffer(qshape, dt), kc: T.Buffer(cshape, dt), vc: T.Buffer(cshape, dt),
                  offsets: T.Buffer((Bm,), "int32"), starts: T.Buffer((Bm,), "int32"),
                  out: T.Buffer(qshape, dt)):
        for b in T.parallel(Bm):
            for s, h in T.grid(S, Hq):
                row(q, kc, vc, offsets, starts, out, b, s, h)

    return _opaque(attention, cuda)
