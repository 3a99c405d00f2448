"""Bindings that use a symbolic dim move after the ``match_cast`` that defines it.

A data-dependent length (``Range`` / ``arange`` of a runtime count, a runtime ``ConstantOfShape``)
is a symbolic var ``n`` defined by ``R.match_cast(shape, R.Shape([n]))``. TVM 0.27's FuseOps
places a fused call at its group's first member: a group holding ``cast(x)`` (before the
match_cast) and ``arange(0, n)`` (after it) is called before ``n`` exists, and the VM lowering
fails with "PrimExpr n has not been computed". Within each dataflow block this pass reorders the
bindings stably (original order wherever dependencies allow) so that each comes after the
bindings of the Relax vars it reads and of the symbolic vars its value and type use::

    lv = fused(x, R.shape([n]))       ...                       (uses n)
    s = R.match_cast(t, R.Shape([n])) →  s = R.match_cast(...)
                                          lv = fused(x, R.shape([n]))

Sits right after FuseOps, before FuseTIR. A module without symbolic dims is returned unchanged.
"""

from __future__ import annotations

import heapq

import tvm
from tvm import relax

from ._util import rewrite_functions


def _defined_symbols(binding: relax.Binding) -> list:
    if not isinstance(binding, relax.MatchCast):
        return []
    return list(relax.analysis.definable_tir_vars_in_type(binding.ty))


def _used_symbols(binding: relax.Binding) -> list:
    used = list(relax.analysis.free_symbolic_vars(binding.value)) if isinstance(
        binding.value, relax.Expr) else []
    return used + list(relax.analysis.tir_vars_in_type(binding.var.ty))


def _order(block: relax.DataflowBlock) -> relax.DataflowBlock:
    bindings = list(block.bindings)
    var_def = {b.var: i for i, b in enumerate(bindings)}
    sym_def: dict = {}
    for i, b in enumerate(bindings):
        for s in _defined_symbols(b):
            sym_def.setdefault(s, i)
    deps: list[set[int]] = []
    for i, b in enumerate(bindings):
        d = {var_def[v] for v in relax.analysis.free_vars(b.value) if v in var_def}
        d |= {sym_def[s] for s in _used_symbols(b) if s in sym_def and sym_def[s] != i}
        deps.append(d - {i})
    if all(j < i for i, d in enumerate(deps) for j in d):
        return block
    users: list[list[int]] = [[] for _ in bindings]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    waiting = [len(d) for d in deps]
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
    if len(order) != len(bindings):  # a cycle: leave the block as it is
        return block
    return relax.DataflowBlock([bindings[i] for i in order])


def _order_function(func: relax.Function) -> relax.Function:
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return func
    blocks = [_order(b) if isinstance(b, relax.DataflowBlock) else b for b in body.blocks]
    if all(a.same_as(b) for a, b in zip(blocks, body.blocks)):
        return func
    seq = relax.BlockBuilder().normalize(relax.SeqExpr(blocks, body.body, body.span))
    return relax.Function(func.params, seq, func.ret_ty,
                          func.is_pure, func.attrs, func.span)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.OrderSymbolicDefs")
class OrderSymbolicDefs:
    """Move each binding after the ``match_cast`` defining the symbolic dims it uses."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _order_function)
