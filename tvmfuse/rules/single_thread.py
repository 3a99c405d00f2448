"""The last GPU rule: a kernel no other rule schedules runs on one GPU thread.

Sequential ``te.extern`` kernels (ONNX ``Det``'s LU factorisation, ``NonMaxSuppression``'s greedy
loop) are one opaque block with no spatial iterators, so every dlight rule declines them. Left
without a thread binding, ``relax.build`` compiles such a function for the *host*, where it would
dereference the device pointers of its CUDA tensors. Here its body goes under a
``blockIdx.x``/``threadIdx.x`` launch of extent 1: slow, but correct and on the device.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.ir import IRModule, Range
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

from ..attrs import RULE_ATTR


def _launch(body: tirx.Stmt) -> tirx.Stmt:
    """``body`` under one-iteration ``blockIdx.x`` and ``threadIdx.x`` loops."""
    for tag in ("threadIdx.x", "blockIdx.x"):
        var = tirx.Var(tag.replace(".", "_"), "int32")
        axis = tirx.IterVar(Range(0, 1), tirx.Var(tag, "int32"), tirx.IterVar.ThreadIndex, tag)
        body = tirx.For(var, tirx.IntImm("int32", 0), tirx.IntImm("int32", 1),
                        tirx.ForKind.THREAD_BINDING, body, axis)
    return body


def runs_on_device(func: tirx.PrimFunc, target: Target) -> bool:
    """Whether every memory access of ``func`` is inside a GPU thread (TVM's ``VerifyMemory``,
    on the function with its blocks lowered: it reads thread extents, not bound loops)."""
    mod = IRModule({"main": func.with_attr("target", target)})
    lower = [s_tir.transform.LowerInitBlock(), s_tir.transform.ConvertBlocksToOpaque(),
             s_tir.transform.LowerOpaqueBlock()]
    for pass_ in lower:
        mod = pass_(mod)
    return bool(tirx.analysis.verify_memory(mod["main"]))


def on_one_thread(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its whole body (inside the root block, if any) run by one GPU thread."""
    realize = func.body
    if not isinstance(realize, s_tir.SBlockRealize):
        return func.with_body(_launch(realize))
    root = realize.block
    block = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                         _launch(root.body), root.init, root.alloc_buffers, root.match_buffers,
                         root.annotations)
    return func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, block))


class SingleThread(GPUScheduleRule):
    """Any function whose memory accesses are outside a GPU thread (``verify_memory`` fails):
    all of it on one thread. Tried after every other rule."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        if runs_on_device(func, target):
            return None  # already binds its threads (or touches no memory): not this rule's
        if any(_is_empty(buf) for buf in _root_buffers(func)):
            # CUDA codegen allocates no zero-size array (an empty Split piece); the kernel stays
            # unscheduled, as before this rule (known gap: it then runs on the host).
            return None
        launched = on_one_thread(_intermediates_local(func)).with_attr(RULE_ATTR, "single_thread")
        return s_tir.Schedule(launched)


def _root_buffers(func: tirx.PrimFunc) -> list:
    """The buffers the root block of ``func`` allocates (none without a root block)."""
    body = func.body
    return list(body.block.alloc_buffers) if isinstance(body, s_tir.SBlockRealize) else []


def _is_empty(buf) -> bool:
    """Whether ``buf`` has a static zero extent."""
    return any(isinstance(d, tirx.IntImm) and d.value == 0 for d in buf.shape)


def _intermediates_local(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with the intermediate buffers of its root block in ``local`` scope: CUDA cannot
    allocate global memory inside a kernel, and one thread alone reads them."""
    sch = s_tir.Schedule(func)
    try:
        root = sch.get_sblock("root")
    except s_tir.ScheduleError:
        return func  # no root block (a te.extern kernel): nothing allocated outside its body
    scratch = list(sch.get(root).alloc_buffers)
    for block in sch.get_child_blocks(root):
        for index, region in enumerate(sch.get(block).writes):
            if any(buf.same_as(region.source) for buf in scratch):
                sch.set_scope(block, index, "local")
    return sch.mod["main"]
