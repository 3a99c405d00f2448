"""Position tables: a cache-less LM's ``arange(S)`` position math → per-sequence positions.

A causal LM written without a cache computes its position-dependent values from the sequence
length alone: RoPE's cos/sin from ``arange(S)`` and ``inv_freq`` (transformers), a slice
``cos[:S]`` of a precomputed table (models/llama_lm.py), GPT-2's ``wpe[arange(S)]``. With a KV
cache the positions of a call are ``offset_b + s`` per sequence, so every such value is rewritten::

    F(S)  (dims with one S axis, computed from constants and S only; read by the model's data)
      →  F_b[..., s, ...] = T[..., positions[b, s], ...],    T = F(max_seq)   (a constant table)

where ``positions`` (B, S) int64 becomes a new parameter after the token ids and ``T`` is
evaluated at compile time. The rewrite is exact only when row s of ``F(S)`` does not depend on S:
this is checked by evaluating ``F`` at two lengths (``F(n) == T[..., :n, ...]``). The result
gains the batch axis: ``F`` (1, ..., S, ...) (rank-padded to its reader's rank) becomes
(B, ..., S, ...). Values with two S axes (causal masks) are left to the attention rewrite; any
other position-dependent value (an S inside a product, a batch axis, a non-elementwise reader)
is refused with a :class:`~tvmfuse.errors.CompileError` naming its binding.

Input: ``main(ids: (B, S))`` with symbolic B and S, straight from the frontend. Sits first, before
the shapes are bound per entry point (the tables need the symbolic S).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.sym import Analyzer

from ..errors import CompileError
from ._graph import bindings, evaluate, param_free, users, var_name

_ELEMENTWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.where"}


def _dims(var: relax.Var) -> list:
    return list(var.ty.shape.values) if var.ty.shape is not None else []


def _refuse(var: relax.Var, why: str) -> CompileError:
    return CompileError(f"compile_lm: cannot derive per-sequence positions: binding "
                        f"{var_name(var)!r} ({var.ty}) {why}")


def _gather(table: np.ndarray, axis: int, positions: relax.Var, batch, seq) -> relax.Expr:
    """``table`` (1, ..., M, ...) gathered at ``positions`` (B, S) along ``axis`` → (B, ..., S, ...)."""
    dims = list(table.shape)
    flat = relax.op.reshape(positions, [batch * seq])
    g = relax.op.take(relax.const(table), flat, axis=axis)
    g = relax.op.reshape(g, dims[:axis] + [batch, seq] + dims[axis + 1:])
    perm = [axis] + list(range(axis)) + list(range(axis + 1, len(dims) + 1))
    g = relax.op.permute_dims(g, perm)
    return relax.op.reshape(g, [batch] + dims[1:axis] + [seq] + dims[axis + 1:])


def position_frontier(func: relax.Function, seq: tvm.tirx.Var,
                      max_seq: int) -> list[tuple[relax.Var, int, int]]:
    """``(var, S axis, reader rank)`` of each position table the model's data reads (see module doc).

    A dim equal to S for every S in 1..``max_seq`` counts as S (``cos[:S]`` of a table of
    ``max_seq`` rows has ``min(S, max_seq)`` rows)."""
    analyzer = Analyzer()
    analyzer.bind(seq, tvm.ir.Range(1, max_seq + 1))

    def is_seq(d) -> bool:
        return d.same_as(seq) or analyzer.can_prove_equal(d, seq)

    table = bindings(func)
    free = param_free(table)
    readers = users(table, func.body.body)
    found = []
    for var in table:
        if var not in free or not isinstance(var.ty, relax.TensorType):
            continue
        outside = [u for u in readers.get(var, []) if u is None or u not in free]
        dims = _dims(var)
        uses_seq = [i for i, d in enumerate(dims)
                    if any(v.same_as(seq) for v in tvm.tirx.analysis.undefined_vars(d))]
        if not outside or not uses_seq:
            continue
        if len(uses_seq) == 2 and all(is_seq(dims[i]) for i in uses_seq):
            continue  # (.., S, S): a mask; the attention rewrite checks it is causal
        axis = uses_seq[0]
        if len(uses_seq) != 1 or not is_seq(dims[axis]):
            raise _refuse(var, "has S inside a shape product or on several axes")
        if any(not isinstance(d, tvm.tirx.IntImm) for i, d in enumerate(dims) if i != axis):
            raise _refuse(var, "has a symbolic dimension besides S (e.g. the batch)")
        ranks = set()
        for user in outside:
            value = table.get(user) if user is not None else None
            if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                    and value.op.name in _ELEMENTWISE):
                raise _refuse(var, "is read by something other than a broadcasting elementwise op")
            ranks.add(user.ty.ndim)  # its shape may be unknown (S against min(S, M))
        if len(ranks) != 1:
            raise _refuse(var, f"is read at several ranks {sorted(ranks)}")
        found.append((var, axis, ranks.pop()))
    return found


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.llm.PositionTables")
class PositionTables:
    """``main(ids)`` → ``main(ids, positions)`` with position tables gathered per sequence."""

    def __init__(self, max_seq: int) -> None:
        self.max_seq = max_seq

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        func = mod["main"]
        ids = func.params[0]
        batch, seq = _dims(ids)
        frontier = position_frontier(func, seq, self.max_seq)
        out = mod.clone()
        positions = relax.Var("positions", relax.TensorType([batch, seq], "int64"))
        if not frontier:
            out["main"] = _with_param(func, positions, {})
            return out
        table = bindings(func)
        sizes = {str(batch): 1, str(seq): self.max_seq}
        full = evaluate(table, [v for v, _, _ in frontier], sizes)
        short = self.max_seq // 2 + 1
        part = evaluate(table, [v for v, _, _ in frontier], sizes | {str(seq): short})
        repl = {}
        for (var, axis, rank), t, p in zip(frontier, full, part):
            if not np.array_equal(np.take(t, np.arange(short), axis=axis), p, equal_nan=True):
                raise _refuse(var, "differs at a position when the length changes: not a function "
                              "of the position alone")
            pad = rank - t.ndim
            t = t.reshape((1,) * pad + t.shape)
            if pad + axis == 0 or t.shape[0] != 1:
                why = "has no broadcast batch axis in front of its S axis"
                if t.ndim == 3 and t.shape[0] > 1 and t.shape[1] == 1:
                    why += (" (a per-head bias over key positions with batch and heads folded, "
                            "as ALiBi (Bloom, MPT): the derived cache does not carry one yet)")
                raise _refuse(var, why)
            repl[var] = _gather(t, pad + axis, positions, batch, seq)
        out["main"] = _with_param(func, positions, repl)
        return out


@relax.expr_functor.mutator
class _Replace(relax.PyExprMutator):
    """Rebinds the given vars to new expressions (emitted through the block builder)."""

    def __init__(self, repl: dict[relax.Var, relax.Expr]) -> None:
        super().__init__()
        self.repl = repl

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.repl:
            super().visit_var_binding_(binding)
            return
        new = self.builder_.emit(self.repl[binding.var], name_hint=var_name(binding.var))
        self.set_var_remap(binding.var, new)


def _with_param(func: relax.Function, param: relax.Var, repl: dict[relax.Var, relax.Expr]) -> relax.Function:
    body = _Replace(repl).visit_expr(func.body) if repl else func.body
    new = relax.Function([*func.params, param], body, func.ret_ty, func.is_pure, func.attrs)
    mod = relax.transform.DeadCodeElimination()(tvm.IRModule({"main": new}))
    return mod["main"]
