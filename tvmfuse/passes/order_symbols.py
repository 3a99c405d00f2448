"""Bindings that use a symbolic dim come after the ``match_cast`` that defines it.

A shape-like value known only at run time (an ONNX ``Reshape`` target, a ``Range`` length, …)
is bound to symbolic dims by ``match_cast(tensor_to_shape(t), R.Shape([n, …]))``; the kernels
after it read ``n`` through their shapes and ``tir_vars`` only, not through a Relax variable.
``FuseOps`` orders a fused group by its Relax inputs alone, so a group that needs ``n`` (but no
tensor from after the ``match_cast``) can land before it, and the VM then reads an undefined
``n`` ("PrimExpr … has not been computed"). Per dataflow block, this pass sorts the bindings
topologically over both kinds of edges (Relax variable def → use, symbol def → use), keeping
the original order wherever it is already valid. A block with no symbol defined in it is left
alone. Must run after ``FuseOps`` / ``FuseTIR`` and before the VM lowering (``ToNonDataflow``).
"""

from __future__ import annotations

import heapq

import tvm
import tvm_ffi
from tvm import relax, tirx


def _symbols(node) -> set[tirx.Var]:
    """The TIR variables ``node`` mentions (shapes, ``tir_vars``, PrimValues). Relax and TIR
    variables share one class in 0.27; a symbol's type is a ``PrimType``."""
    found: list[tirx.Var] = []
    tvm_ffi.structural_walk(node, (tirx.Var, found.append), order="post")
    return {v for v in found if isinstance(v.ty, tvm.ir.PrimType)}


def _order(block: relax.DataflowBlock) -> relax.DataflowBlock | None:
    """``block`` with its bindings topologically sorted, or None when already in order."""
    bindings = list(block.bindings)
    definer: dict[tirx.Var, int] = {}
    for i, b in enumerate(bindings):
        if isinstance(b, relax.MatchCast):
            for v in _symbols(b.ty):
                definer.setdefault(v, i)
    if not definer:
        return None
    index = {b.var: i for i, b in enumerate(bindings)}
    after: list[set[int]] = [set() for _ in bindings]  # after[i]: bindings that must precede i
    for i, b in enumerate(bindings):
        for v in relax.analysis.free_vars(b.value):
            if v in index and index[v] != i:
                after[i].add(index[v])
        for v in _symbols(b.value) | _symbols(b.var.ty):
            if v in definer and definer[v] != i and v not in index:
                after[i].add(definer[v])
    users: list[list[int]] = [[] for _ in bindings]
    for i, deps in enumerate(after):
        for d in deps:
            users[d].append(i)
    waiting = [len(deps) for deps in after]
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(bindings) or order == list(range(len(bindings))):
        return None  # a cycle (never in well-formed IR) or nothing to move
    return relax.DataflowBlock([bindings[i] for i in order])


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.OrderSymbolDefinitions")
class OrderSymbolDefinitions:
    """Every dataflow binding after the ``match_cast`` defining the symbols it uses."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            blocks = [(_order(b) if isinstance(b, relax.DataflowBlock) else None) or b
                      for b in func.body.blocks]
            if any(new is not old for new, old in zip(blocks, func.body.blocks)):
                body = relax.SeqExpr(blocks, func.body.body)
                updates[gvar] = relax.Function(func.params, body, func.ret_ty, is_pure=func.is_pure,
                                               attrs=func.attrs)
        if not updates:
            return mod
        mod = mod.clone()  # assigned into below: not the caller's module
        for gvar, func in updates.items():
            mod[gvar] = func
        return relax.transform.Normalize()(mod)
