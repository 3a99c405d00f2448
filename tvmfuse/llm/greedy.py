"""Greedy decoding on the device: the next token and the decode state advanced in place.

Entry point ``advance`` of a ``compile_lm`` library (``Bm`` = max_batch, ``H`` = max_seq + 1)::

    advance(logits (Bm, V), ids (Bm, 1) int64, positions (Bm, 1) int64, offsets (Bm,) int32,
            history (Bm, H) int64)                                    all but logits in place

    t_b = argmax_v logits[b, v]      (the first maximum, numpy's rule; fp32 compare)
    history[b, min(offsets[b] + 1, H − 1)] = t_b;  ids[b, 0] = t_b;  positions[b, 0] += 1;
    offsets[b] += 1

A decode step is then ``decode`` + ``advance`` on the same device tensors every time: no host
copy per token, and the pair can be captured once as a CUDA graph and replayed
(:mod:`tvmfuse.runtime.lm`). CUDA: one block of 1024 threads per sequence; each thread takes
16-byte vectors of the logits, vector i at index (i·1024 + thread)·vec, loading 8 of them before
comparing (first maximum within the thread); warp shuffles, then warp 0 shuffles over the 32 warps'
results, keep (value, first index).

With ``pdl`` (the kernel launches programmatically after the LM head, sm_90): thread 0 reads the
sequence's position and offset before ``griddepcontrol.wait``. Only this kernel writes them, and
the previous step's ``advance`` completed before any kernel of this step passed its wait; so the
only loads left after the argmax are none, and the state stores follow it directly.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.script import tirx as T

from .kernels import _opaque

_THREADS = 1024
_GROUP = 8  # rounds of vector loads in flight per thread before their compares
_ALL = T.uint32(0xFFFFFFFF)


def greedy_advance(batch: int, vocab: int, history: int, dtype: str, cuda: bool,
                   pdl: bool = False) -> tvm.tirx.PrimFunc:
    """``(ids, positions, offsets, history, logits)``: the in-place step of the module doc
    (``pdl``: the state read before the programmatic-launch wait, CUDA only)."""
    Bm, V, H = batch, vocab, history
    # CUDA: 16-byte loads where V allows; a thread's elements, in index order, come in rounds of
    # _THREADS · vec, _GROUP rounds loaded before any compare (a scan that compared each load
    # before issuing the next took 25 µs for the 7B's 32000 logits, H200 session 15)
    vec = 16 // (tvm.DataType(dtype).bits // 8)
    vec = vec if V % vec == 0 else 1
    rounds = (V + _THREADS * vec - 1) // (_THREADS * vec)
    group = min(rounds, _GROUP)
    groups = (rounds + group - 1) // group

    @T.macro
    def finish(ids, positions, offsets, hist, b, tok, position, offset):
        hist[b, T.min(offset + 1, H - 1)] = T.Cast("int64", tok)
        ids[b, 0] = T.Cast("int64", tok)
        positions[b, 0] = position + T.int64(1)
        offsets[b] = offset + 1

    @T.macro
    def load(vals, logits, b, r, base):
        if base < V:
            if vec > 1:
                vals[T.ramp(r * vec, 1, vec)] = logits[b, T.ramp(base, 1, vec)]
            else:
                vals[r] = logits[b, base]

    @T.macro
    def butterfly(best, arg, other, oarg):
        # (value, first index) over the 32 lanes of a warp: the larger value, on ties the lower index
        for k in T.unroll(5):
            other[0] = T.tvm_warp_shuffle_xor(_ALL, best[0], 1 << k, 32, 32)
            oarg[0] = T.tvm_warp_shuffle_xor(_ALL, arg[0], 1 << k, 32, 32)
            if other[0] > best[0] or (other[0] == best[0] and oarg[0] < arg[0]):
                best[0] = other[0]
                arg[0] = oarg[0]

    if cuda:

        @T.prim_func
        def advance(ids: T.Buffer((Bm, 1), "int64"), positions: T.Buffer((Bm, 1), "int64"),
                    offsets: T.Buffer((Bm,), "int32"), hist: T.Buffer((Bm, H), "int64"),
                    logits: T.Buffer((Bm, V), dtype)):
            T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
            with T.launch_thread("blockIdx.x", Bm) as b:
                tx = T.launch_thread("threadIdx.x", _THREADS)
                vals = T.alloc_buffer((group * vec,), dtype, scope="local", align=16)
                best = T.alloc_buffer((1,), "float32", scope="local")
                arg = T.alloc_buffer((1,), "int32", scope="local")
                other = T.alloc_buffer((1,), "float32", scope="local")
                oarg = T.alloc_buffer((1,), "int32", scope="local")
                sv = T.alloc_buffer((_THREADS // 32,), "float32", scope="shared")
                si = T.alloc_buffer((_THREADS // 32,), "int32", scope="shared")
                state = T.alloc_buffer((2,), "int64", scope="local")
                if pdl:
                    if tx == 0:  # written only by this kernel, whose last run is complete
                        state[0] = positions[b, 0]
                        state[1] = T.Cast("int64", offsets[b])
                    T.ptx.griddepcontrol.wait()
                    T.ptx.griddepcontrol.launch_dependents()
                best[0] = T.float32(float("-inf"))
                arg[0] = V
                for g in T.serial(groups):
                    for r in T.unroll(group):
                        load(vals, logits, b, r, ((g * group + r) * _THREADS + tx) * vec)
                    for r in T.unroll(group):
                        for e in T.unroll(vec):
                            if ((g * group + r) * _THREADS + tx) * vec + e < V:
                                if T.Cast("float32", vals[r * vec + e]) > best[0] or arg[0] == V:
                                    best[0] = T.Cast("float32", vals[r * vec + e])
                                    arg[0] = ((g * group + r) * _THREADS + tx) * vec + e
                butterfly(best, arg, other, oarg)  # over the warp's lanes
                if tx % 32 == 0:
                    sv[tx // 32] = best[0]
                    si[tx // 32] = arg[0]
                T.tvm_storage_sync("shared")
                if tx < 32:  # warp 0 over the warps' (value, first index)
                    best[0] = sv[tx]
                    arg[0] = si[tx]
                    butterfly(best, arg, other, oarg)
                    if tx == 0:
                        if not pdl:
                            state[0] = positions[b, 0]
                            state[1] = T.Cast("int64", offsets[b])
                        finish(ids, positions, offsets, hist, b, T.min(arg[0], V - 1), state[0],
                               T.Cast("int32", state[1]))

        return _opaque(advance, cuda)

    @T.prim_func(s_tir=True)
    def advance(ids: T.Buffer((Bm, 1), "int64"), positions: T.Buffer((Bm, 1), "int64"),
                offsets: T.Buffer((Bm,), "int32"), hist: T.Buffer((Bm, H), "int64"),
                logits: T.Buffer((Bm, V), dtype)):
        T.func_attr({"tir.noalias": True})
        for b in T.serial(Bm):
            with T.sblock("advance"):
                T.reads()
                T.writes()
                best = T.sblock_alloc_buffer((1,), "float32")
                arg = T.sblock_alloc_buffer((1,), "int32")
                best[0] = T.Cast("float32", logits[b, 0])
                arg[0] = 0
                for v in T.serial(1, V):
                    if T.Cast("float32", logits[b, v]) > best[0]:
                        best[0] = T.Cast("float32", logits[b, v])
                        arg[0] = v
                finish(ids, positions, offsets, hist, b, arg[0], positions[b, 0], offsets[b])

    return _opaque(advance, cuda)


def advance_module(batch: int, vocab: int, history: int, dtype: str, cuda: bool,
                   pdl: bool = False) -> tvm.IRModule:
    """The Relax entry ``advance`` (module doc) with its kernel ``greedy_advance``."""
    bb = relax.BlockBuilder()
    types = [relax.TensorType([batch, 1], "int64"), relax.TensorType([batch, 1], "int64"),
             relax.TensorType([batch], "int32"), relax.TensorType([batch, history], "int64")]
    logits = relax.Var("logits", relax.TensorType([batch, vocab], dtype))
    state = [relax.Var(n, t) for n, t in zip(("ids", "positions", "offsets", "history"), types)]
    with bb.function("advance", [logits, *state]):
        kernel = bb.add_func(greedy_advance(batch, vocab, history, dtype, cuda, pdl),
                             "greedy_advance")
        out = bb.emit(relax.op.call_tir_inplace(kernel, relax.Tuple([*state, logits]), [0, 1, 2, 3],
                                                types))
        bb.emit_func_output(out)
    return bb.finalize()
