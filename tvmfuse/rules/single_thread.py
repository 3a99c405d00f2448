"""Last resort for CUDA: a kernel no other rule takes and no loop of which is thread-bound runs
on one GPU thread.

``te.extern`` kernels written as sequential code (ONNX NonMaxSuppression, Det, …) are one opaque
block with no thread bindings, which dlight's Fallback does not take. Left so, TVM builds such a
PrimFunc as a *host* function that reads the tensors' device pointers on the CPU: a segfault (or,
when it was the library's only kernel, "no CUDA module"). Here the body is wrapped as::

    for bx in blockIdx.x (1):
      for tx in threadIdx.x (1):
        <the original body, unchanged>

Slow by design (one thread), correct, and only for what nothing else schedules; the rule marks
the function ``tvmfuse.rule = "single_thread"`` so ``tvmfuse report`` shows it.
"""

from __future__ import annotations

from tvm import ir, s_tir, tirx
from tvm.target import Target

from ..attrs import RULE_ATTR


def _thread_bound(stmt) -> bool:
    """Whether a loop under ``stmt`` is bound to a GPU thread (or a thread extent launched).
    TIR 0.27 has no Python statement visitor: the walk follows the statement fields."""
    if isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.THREAD_BINDING:
        return True
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent":
        return True
    children = list(getattr(stmt, "seq", None) or [])
    children += [getattr(stmt, f, None) for f in ("body", "block", "then_case", "else_case", "init")]
    return any(_thread_bound(c) for c in children if isinstance(c, tirx.Stmt))


def _one_thread(body: tirx.Stmt) -> tirx.Stmt:
    for tag in ("threadIdx.x", "blockIdx.x"):  # innermost first
        var = tirx.Var(tag.replace(".", "_"), "int64")
        one = tirx.const(1, "int64")
        iv = tirx.IterVar(ir.Range.from_min_extent(tirx.const(0, "int64"), one), var,
                          tirx.IterVar.ThreadIndex, tag)
        body = tirx.For(var, tirx.const(0, "int64"), tirx.const(1, "int64"),
                        tirx.ForKind.THREAD_BINDING, body, thread_binding=iv)
    return body


class SingleThread:
    """``apply(func, target, tunable) → Schedule | None``: CUDA functions without thread-bound
    loops, their body launched on one block of one thread."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if target is None or target.kind.name != "cuda" or _thread_bound(func.body):
            return None
        body = func.body
        if isinstance(body, s_tir.SBlockRealize):  # keep the root block, launch inside it
            block = body.block
            new_block = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint,
                                     _one_thread(block.body), block.init, block.alloc_buffers,
                                     block.match_buffers, block.annotations)
            body = s_tir.SBlockRealize(body.iter_values, body.predicate, new_block)
        else:
            body = _one_thread(body)
        launched = func.with_body(body).with_attr(RULE_ATTR, "single_thread")
        return s_tir.Schedule(ir.IRModule({"main": launched}))
