"""Injective / elementwise fused kernels: add, mul, gelu, silu, casts, bias broadcasts.

Every block must be spatial (no reduction, no opaque iterators); anything else returns ``None``.
All producers are inlined into the output block(s); each remaining block is scheduled as

    for bx in blockIdx.x:            # ceil(outer · inner / V / T) blocks
      for tx in threadIdx.x:         # T = 256 threads
        in_local[V]  = in[...]       # one 16-byte vector load per contiguous input
        out_local[v] = f(in_local[v], other inputs...)   for v in 0..V-1 (unrolled, scalar)
        out[...]     = out_local[V]  # one 16-byte vector store

``V`` = 16 bytes / the narrowest dtype among the output and the contiguous inputs (8 × fp16,
4 × fp32; a wider dtype is copied as several 16-byte vectors), halved until it divides the
innermost extent; when it reaches 1 (odd innermost extent, symbolic shapes) the block falls back
to one scalar element per thread. An input is "contiguous"
when its last index is the innermost loop variable (a bias ``b[j]`` of ``y[i, j]`` is); the other
inputs (transposed reads, ``b[i, 0]``) stay scalar loads inside the compute. Loads and stores are
separate copy blocks so the vectorised code is a plain ``uint4`` copy: TVM's CUDA codegen has no
8-lane fp32 vectors, which the intermediate math of a half-precision chain would otherwise need.
On the H200 a 5-op fp16 chain over 64 Mi elements (3 streams) runs at 3.77 TB/s (kernel time).
"""

from __future__ import annotations

import tvm_ffi
from tvm import DataType, s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

RULE_ATTR = "tvmfuse.rule"  # PrimFunc attribute naming the tvmfuse rule that scheduled it
NAME = "elementwise"
VECTOR_BYTES = 16
THREADS = 256


def _bytes(buffer) -> int:
    return max(1, DataType(str(buffer.dtype)).bits // 8)


def _is_bool(buffer) -> bool:
    return str(buffer.dtype) == "bool"


def _int(e) -> int | None:
    if isinstance(e, int):
        return e
    if isinstance(e, tirx.IntImm):
        return int(e.value)
    return None


def _in_bounds_contiguous(region, buffer, iter_vars) -> bool:
    """The read is ``buf[..., v_last]`` with every index an iterator spanning its dim exactly (or
    a constant inside it): in bounds by construction, so a vector copy of it is safe."""
    if not region or len(region) != len(buffer.shape):
        return False
    last = iter_vars[-1]
    if not region[-1].min.same_as(last.var):
        return False
    for rng, dim in zip(region, buffer.shape):
        if _int(rng.extent) != 1:
            return False
        var = next((iv for iv in iter_vars if rng.min.same_as(iv.var)), None)
        if var is not None:
            if _int(var.dom.extent) is None or _int(var.dom.extent) != _int(dim):
                return False
        elif _int(rng.min) is None or not 0 <= _int(rng.min) < (_int(dim) or 0):
            return False
    # The innermost iterator appears in the last index only.
    return all(not _uses(rng.min, last.var) for rng in region[:-1])


def _uses(expr, var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, (tirx.Var, lambda v: found.append(v.same_as(var))), order="post")
    return any(found)


def vector_copy(sch: s_tir.Schedule, loop, lanes: int) -> None:
    """Vectorise a copy loop in pieces of at most ``lanes`` (16 bytes): an 8-wide fp32 copy becomes
    two ``float4`` accesses (TVM's CUDA codegen has no 32-byte vector types)."""
    extent = _int(sch.get(loop).extent)
    if extent is not None and extent > lanes and extent % lanes == 0:
        outer, loop = sch.split(loop, [None, lanes])
        sch.unroll(outer)
    sch.vectorize(loop)


class Elementwise(GPUScheduleRule):
    """Purely spatial functions: fused loops, 256 threads, 16-byte vector loads and stores."""

    def __init__(self, threads: int = THREADS) -> None:
        self.threads = threads

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return self._schedule(func)
        except Exception:  # noqa: BLE001 - a primitive refusing means "not this rule's shape"
            return None

    def _schedule(self, func: tirx.PrimFunc) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or any(set(b.dom_kind()) - {"S"} for b in infos):
            return None
        if any(not b.dom_kind() for b in infos):
            return None  # a scalar block: nothing to spread over threads
        infos = try_inline(sch, infos)
        params = set(func.params)
        for info in infos:
            stmt = sch.get(info.block_rv)
            if len(stmt.writes) != 1 or stmt.writes[0].source not in params:
                return None  # an intermediate that could not be inlined: leave it to others
        for info in infos:
            self._schedule_block(sch, info.block_rv, params)
        return s_tir.Schedule(sch.mod["main"].with_attr(RULE_ATTR, NAME))

    def _schedule_block(self, sch: s_tir.Schedule, block, params: set) -> None:
        stmt = sch.get(block)
        iters = list(stmt.iter_vars)
        inner = _int(iters[-1].dom.extent)
        out = stmt.writes[0]
        # bool has no CUDA vector type in TVM's codegen ("Cannot convert type T.boolx16"): scalar.
        loads = [r.source for r in stmt.reads if r.source in params and not _is_bool(r.source)
                 and _in_bounds_contiguous(r.region, r.source, iters)]
        store = not _is_bool(out.source) and _in_bounds_contiguous(out.region, out.source, iters)
        vec = 1
        if inner is not None and store:
            vec = VECTOR_BYTES // min(_bytes(b) for b in [out.source, *loads])
            while vec > 1 and inner % vec:
                vec //= 2
        loops = sch.get_loops(block)
        if vec == 1:
            bx, tx = sch.split(sch.fuse(*loops), [None, self.threads])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            return
        outer, v = sch.split(loops[-1], [None, vec])
        bx, tx = sch.split(sch.fuse(*loops[:-1], outer), [None, self.threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.unroll(v)
        for buffer in dict.fromkeys(loads):  # one copy per distinct input
            index = next(i for i, r in enumerate(sch.get(block).reads) if r.source.same_as(buffer))
            cache = sch.cache_read(block, index, "local")
            sch.compute_at(cache, tx, preserve_unit_loops=False)
            vector_copy(sch, sch.get_loops(cache)[-1], VECTOR_BYTES // _bytes(buffer))
        write = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(write, tx, preserve_unit_loops=False)
        vector_copy(sch, sch.get_loops(write)[-1], VECTOR_BYTES // _bytes(out.source))
