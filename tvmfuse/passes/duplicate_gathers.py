"""A gather read by several elementwise kernels becomes one copy per reader, so each fuses it.

RoPE's tables are gathered once per call and read by every layer's q and k rotation::

    cos = call_tir(take, (cos_table, positions))          # (B, 1, S, D), its own kernel
    q1 = call_tir(multiply, (q, cos));  k1 = call_tir(multiply, (k, cos));  ...

FuseOps fuses an injective producer only into its post-dominator, which for ``cos`` lies past
every layer: the gather stays a kernel of its own and writes a tensor the rotations read back.
Given one copy per reader, each copy has one consumer and fuses into that rotation's kernel,
which then reads ``cos_table[positions[b, s], d]`` directly: the same bytes, a kernel fewer
(two per call for cos and sin; at decode each is a launch of its own).

What is copied is a chain: a gather (:func:`~tvmfuse.passes.gather_pattern.is_gather`, injective:
the pass runs after ``InjectiveGather``) and the injective ops that only reshape it (each reading
the previous link alone), when every reader of every link is the next link or a ``call_tir`` of
an elementwise or broadcast PrimFunc (``op_pattern`` ≤ 1) in the same dataflow block: a GEMM or
reduction reading the chain keeps the single copy (its kernel would not fuse a producer), and
only small gathers (≤ :data:`MAX_BYTES`): a decode step's tables are a few KiB and the launch is
what costs; a 7B prefill's (2048 positions, 512 KiB each) made its q and k rotations 340 µs
slower in all (32 layers, H200, session 14) for two launches saved. Runs before ``FuseOps``.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, tirx

from ._util import call_tir_args, op_pattern, with_call_tir_args
from .gather_pattern import INJECTIVE, is_gather

_ELEMENTWISE_MAX = 1  # kElemWise 0, kBroadcast 1
MAX_BYTES = 64 * 1024  # gather outputs copied per reader at most this large (module doc)


def _small(var: relax.Var) -> bool:
    """A tensor of static shape of at most :data:`MAX_BYTES`."""
    shape = getattr(var.ty, "shape", None)
    dims = getattr(shape, "values", None)
    if dims is None or not all(isinstance(d, tirx.IntImm) for d in dims):
        return False
    return math.prod(int(d) for d in dims) * tvm.DataType(str(var.ty.dtype)).bits // 8 <= MAX_BYTES


def _pattern_at_most(mod: tvm.IRModule, call: relax.Expr, most: int) -> bool:
    callee = call.args[0]
    if not isinstance(callee, tvm.ir.GlobalVar):
        return False
    pattern = op_pattern(mod[callee])
    return pattern is not None and pattern <= most


def _chains(mod: tvm.IRModule, bindings: list, gathers: set, outside: set) -> dict:
    """var → the bindings computing it from a gather: the gather, then injective ops (reshapes)
    each reading only the previous one (other arguments are not variables)."""
    chains: dict = {}
    for b in bindings:
        args = call_tir_args(b.value)
        if args is None or b.var in outside:
            continue
        if b.value.args[0] in gathers and _small(b.var):
            chains[b.var] = [b]
            continue
        var_args = [a for a in args if isinstance(a, relax.Var)]
        if (len(var_args) == 1 and var_args[0] in chains
                and _pattern_at_most(mod, b.value, INJECTIVE)):
            chains[b.var] = [*chains[var_args[0]], b]
    return chains


def _duplicate_block(mod: tvm.IRModule, block: relax.DataflowBlock, gathers: set,
                     outside: set) -> relax.DataflowBlock | None:
    bindings = list(block.bindings)
    chains = _chains(mod, bindings, gathers, outside)
    readers: dict = {}
    for b in bindings:
        for var in relax.analysis.free_vars(b.value):
            if var in chains:
                readers.setdefault(var, []).append(b)
    # a chain is copied when each member before its end is read by the next link alone, and its
    # end only by elementwise kernels, at least two (each then fuses its copy; one reader shares
    # nothing). Only readers of the end are given a copy below: a member read elsewhere too (a
    # link of another chain — Falcon's ONNX export slices the gathered K, transposed, besides
    # rotating it) keeps the chain whole, else that reader would read a var no longer bound.
    ends = {}
    for var, chain in chains.items():
        inner = all(len(readers.get(b.var, [])) == 1 and readers[b.var][0].var.same_as(nxt.var)
                    for b, nxt in zip(chain, chain[1:]))
        outer = readers.get(var, [])
        elementwise = [call_tir_args(r.value) is not None
                       and _pattern_at_most(mod, r.value, _ELEMENTWISE_MAX) for r in outer]
        if inner and len(outer) >= 2 and all(elementwise):
            ends[var] = chain
    # the members of a copied chain go: each reader of its end gets a copy of the whole chain
    copied = {b.var for var, chain in ends.items() for b in chain}
    if not ends:
        return None
    out = []
    for b in bindings:
        if b.var in copied:
            continue  # each reader gets its copy below
        args = call_tir_args(b.value)
        if args is None or not any(a in ends for a in args):
            out.append(b)
            continue
        copies = {}
        for a in args:
            if a in ends and a not in copies:
                prev = {}
                for link in ends[a]:
                    value = link.value
                    if prev:  # the link reads the previous link's copy
                        value = with_call_tir_args(value, [prev.get(x, x) for x in call_tir_args(value)])
                    new = relax.DataflowVar(f"{link.var.name}_dup", link.var.ty)
                    out.append(relax.VarBinding(new, value))
                    prev = {link.var: new}
                copies[a] = prev[a]
        out.append(relax.VarBinding(b.var, with_call_tir_args(b.value, [copies.get(a, a) for a in args])))
    return relax.DataflowBlock(out)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.DuplicateGathers")
class DuplicateGathers:
    """One copy of a shared gather per elementwise reader (module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        gathers = {gv for gv, f in mod.functions.items()
                   if op_pattern(f) == INJECTIVE and is_gather(f)}
        if not gathers:
            return mod
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            # vars read outside their dataflow block (or returned) keep their one binding
            outside = set(relax.analysis.free_vars(func.body.body))
            for block in func.body.blocks:
                if not isinstance(block, relax.DataflowBlock):
                    for b in block.bindings:
                        outside |= set(relax.analysis.free_vars(b.value))
            blocks, changed = [], False
            for block in func.body.blocks:
                new = (_duplicate_block(mod, block, gathers, outside)
                       if isinstance(block, relax.DataflowBlock) else None)
                changed |= new is not None
                blocks.append(new or block)
            if changed:
                body = relax.SeqExpr(blocks, func.body.body)
                updates[gv] = relax.BlockBuilder().normalize(relax.Function(
                    func.params, body, func.ret_ty, func.is_pure, func.attrs))
        if not updates:
            return mod
        mod = mod.clone()  # not the caller's module
        for gv, func in updates.items():
            mod[gv] = func
        return mod
