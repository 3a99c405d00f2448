"""A gather read by several elementwise kernels becomes one copy per reader, so each fuses it.

RoPE's tables are gathered once per call and read by every layer's q and k rotation::

    cos = call_tir(take, (cos_table, positions))          # (B, 1, S, D), its own kernel
    q1 = call_tir(multiply, (q, cos));  k1 = call_tir(multiply, (k, cos));  ...

FuseOps fuses an injective producer only into its post-dominator, which for ``cos`` lies past
every layer: the gather stays a kernel of its own and writes a tensor the rotations read back.
Given one copy per reader, each copy has one consumer and fuses into that rotation's kernel,
which then reads ``cos_table[positions[b, s], d]`` directly: the same bytes, a kernel fewer
(two per call for cos and sin; at decode each is a launch of its own).

Only gathers (:func:`~tvmfuse.passes.gather_pattern.is_gather`, injective: the pass after
``InjectiveGather``) whose every reader is a ``call_tir`` of an elementwise or broadcast PrimFunc
(``op_pattern`` ≤ 1) in the same dataflow block: a GEMM or reduction reading the gather keeps
the single copy (its kernel would not fuse a producer). Runs before ``FuseOps``.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from .gather_pattern import INJECTIVE, is_gather

_ELEMENTWISE_MAX = 1  # kElemWise 0, kBroadcast 1


def _fuses_a_producer(mod: tvm.IRModule, call: relax.Expr) -> bool:
    """A ``call_tir`` of an elementwise / broadcast PrimFunc (FuseOps fuses injective producers
    into it)."""
    callee = call.args[0]
    if not isinstance(callee, tvm.ir.GlobalVar):
        return False
    func = mod[callee]
    if not isinstance(func, tirx.PrimFunc) or func.attrs is None or "op_pattern" not in func.attrs:
        return False
    return int(func.attrs["op_pattern"]) <= _ELEMENTWISE_MAX


def _call_tir_args(value: relax.Expr) -> list | None:
    """The argument list of a ``call_tir`` (None for anything else)."""
    if (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.call_tir" and isinstance(value.args[1], relax.Tuple)):
        return list(value.args[1].fields)
    return None


def _duplicate_block(mod: tvm.IRModule, block: relax.DataflowBlock, gathers: set,
                     outside: set) -> relax.DataflowBlock | None:
    bindings = list(block.bindings)
    candidates = {}
    for b in bindings:
        args = _call_tir_args(b.value)
        if args is not None and b.value.args[0] in gathers and b.var not in outside:
            candidates[b.var] = b.value
    readers: dict = {}
    for b in bindings:
        for var in relax.analysis.free_vars(b.value):
            if var in candidates:
                readers.setdefault(var, []).append(b)
    dup = {var for var, rs in readers.items()
           if len(rs) >= 2 and all(_call_tir_args(r.value) is not None
                                   and _fuses_a_producer(mod, r.value)
                                   and var in _call_tir_args(r.value) for r in rs)}
    if not dup:
        return None
    out = []
    for b in bindings:
        if b.var in dup:
            continue  # each reader gets its copy below
        args = _call_tir_args(b.value)
        if args is None or not any(a in dup for a in args):
            out.append(b)
            continue
        copies = {}
        for a in args:
            if a in dup and a not in copies:
                copies[a] = relax.DataflowVar(f"{a.name}_dup", a.ty)
                out.append(relax.VarBinding(copies[a], candidates[a]))
        call = b.value
        new_args = relax.Tuple([copies.get(a, a) for a in args])
        out.append(relax.VarBinding(b.var, relax.Call(call.op, [call.args[0], new_args,
                                                               *call.args[2:]],
                                                      call.attrs, call.ty_args, ret_ty=call.ty)))
    return relax.DataflowBlock(out)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.DuplicateGathers")
class DuplicateGathers:
    """One copy of a shared gather per elementwise reader (module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        gathers = {gv for gv, f in mod.functions.items()
                   if isinstance(f, tirx.PrimFunc) and f.attrs is not None and "op_pattern" in f.attrs
                   and int(f.attrs["op_pattern"]) == INJECTIVE and is_gather(f)}
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
