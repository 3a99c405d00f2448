"""Tensor parallelism (Megatron-style): one rank's shard of each entry point of an LM.

For ``N`` ranks, rank ``r`` computes (``W[..]`` = the rank's slice, a constant of the rank)::

    column-parallel   y_r = x · W[:, r-th N-th of the outputs]     (Q/K/V, gate/up, LM head)
    ... heads / FFN intermediate stay split through reshapes, RoPE, attention, SwiGLU ...
    row-parallel      o   = allreduce_sum(y_r · W[r-th N-th of the inputs, :])    (O, down)
    embedding         e   = allreduce_sum(E_r[ids - r·V/N] · [ids in rank r's rows])
    LM head           logits = allgather(x · W_lm[:, r-th N-th of the vocab])   (at the result)

A split axis may hold several segments, each split N ways (a fused QKV's ``Hq·D | Hkv·D | Hkv·D``
outputs: rank r holds the r-th N-th of each). Which matmuls are column-parallel is read from the
graph: a matmul by a constant weight is row-parallel when its input is computed from matmuls by
constant weights through head/elementwise ops only (side inputs that depend on no such matmul,
such as RoPE tables and biases, are replicated); those matmuls are its column-parallel ones. The
split then propagates forward op by op (:class:`_Shard`); an op with no rule for a split input gets
that input all-gathered first, so the result always equals the unsharded function. The collectives
and the rank are ``R.call_dps_packed`` calls of :mod:`tvmfuse.runtime.collectives` (the library is
rank-agnostic: only the weight constants differ between ranks).

Input: static-shape entry points after FuseAttention (``R.nn.attention`` with q/k/v (B,S,H,D)) and
LastTokenLogits; sits before DeriveKVCache (whose cache kernels take the per-rank head counts).
Query and key/value heads of every attention, and every column-parallel output width, must be
divisible by N (else a :class:`~tvmfuse.errors.CompileError` naming the binding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from ..errors import CompileError
from ..runtime.collectives import ALLGATHER, ALLREDUCE_SUM, RANK
from ._graph import bindings, users, var_name

_UNARY = {"relax.astype", "relax.negative", "relax.sigmoid", "relax.tanh", "relax.exp", "relax.sqrt",
          "relax.rsqrt", "relax.erf", "relax.square", "relax.abs", "relax.clip", "relax.nn.silu",
          "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.relu", "relax.sin", "relax.cos"}
_BINARY = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum",
           "relax.minimum", "relax.power", "relax.where"}
_VIEWS = {"relax.reshape", "relax.permute_dims", "relax.strided_slice", "relax.split", "relax.concat",
          "relax.broadcast_to"}
_ATTENTION = "relax.nn.attention"
# what a region between column- and row-parallel matmuls may hold
_REGION_OPS = _UNARY | _BINARY | _VIEWS | {_ATTENTION}
# what may lie between the LM head's matmul and the result
_HEAD_TAIL = {"relax.reshape", "relax.permute_dims", "relax.strided_slice", "relax.astype", "relax.take"}


@dataclass(frozen=True)
class Split:
    """``axis`` holds ``segments`` (global sizes, in order), each split in N contiguous parts."""

    axis: int
    segments: tuple[int, ...]


def _op(value) -> str | None:
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.name
    return None


def _shape(expr: relax.Expr) -> list[int]:
    return [int(d) for d in expr.ty.shape.values]


def _tensor_args(value: relax.Expr) -> list[relax.Expr]:
    """A call's tensor arguments, inline tuples (concat's) flattened."""
    out = []
    for arg in value.args if isinstance(value, relax.Call) else value.fields:
        out += list(arg.fields) if isinstance(arg, relax.Tuple) else [arg]
    return out


def shard_array(array: np.ndarray, split: Split, rank: int, n: int) -> np.ndarray:
    """Rank ``rank``'s part of ``array`` under ``split`` (each segment's r-th N-th, in order)."""
    parts, begin = [], 0
    for size in split.segments:
        part = size // n
        parts.append(np.take(array, np.arange(begin + rank * part, begin + (rank + 1) * part),
                             axis=split.axis))
        begin += size
    return np.concatenate(parts, axis=split.axis)


def _weight(table: dict, expr: relax.Expr) -> tuple[Constant, bool] | None:
    """``(constant, transposed)`` when ``expr`` is a 2-D constant or ``permute_dims`` of one."""
    value = table.get(expr, expr) if isinstance(expr, relax.Var) else expr
    if isinstance(value, Constant) and len(value.ty.shape.values) == 2:
        return value, False
    if _op(value) == "relax.permute_dims" and isinstance(value.args[0], Constant) \
            and len(_shape(value.args[0])) == 2:
        return value.args[0], True
    return None


@dataclass
class Plan:
    """What :class:`_Shard` splits: column-parallel matmuls and vocab-parallel embeddings."""

    column: set
    embeddings: set
    segments: dict  # column matmul → segments of its outputs (a fused QKV's q | k | v)


def _ids_rooted(table: dict, expr: relax.Expr, ids: relax.Var) -> bool:
    while isinstance(expr, relax.Var) and expr in table and _op(table[expr]) in ("relax.astype",
                                                                               "relax.reshape"):
        expr = table[expr].args[0]
    return expr.same_as(ids)


def plan(func: relax.Function, n: int, name: str) -> Plan:
    """Find the column-parallel matmuls and the embeddings of ``func`` (module doc); check heads."""
    table = bindings(func)
    where = f"compile_lm(tensor_parallel={n}): {name}"
    matmuls = {v: c.args[0] for v, c in table.items()
               if _op(c) == "relax.matmul" and _weight(table, c.args[1]) is not None}
    for var, value in table.items():
        if _op(value) == _ATTENTION:
            hq, hkv = _shape(value.args[0])[2], _shape(value.args[1])[2]
            if hq % n or hkv % n:
                raise CompileError(f"{where}: attention at binding {var_name(var)!r} has {hq} query and "
                                   f"{hkv} key/value heads; both must be divisible by {n}")
    depends: set = set()
    for var, value in table.items():
        if var in matmuls or any(u in depends for u in relax.analysis.free_vars(value)):
            depends.add(var)
    column: set = set()
    for x in matmuls.values():
        found = _region(table, matmuls, depends, x)
        column |= found or set()
    readers = users(table, func.body.body)
    for var in matmuls:
        if var not in column and _feeds_result(table, readers, var):
            column.add(var)
    for var in column:
        out = _shape(var)[-1]
        if out % n:
            raise CompileError(f"{where}: the column-parallel matmul at binding {var_name(var)!r} has "
                               f"{out} outputs, not divisible by {n}")
    embeddings = {v for v, c in table.items()
                  if _op(c) == "relax.take" and isinstance(c.args[0], Constant)
                  and len(_shape(c.args[0])) == 2 and int(c.attrs.axis) == 0
                  and _shape(c.args[0])[0] % n == 0 and _ids_rooted(table, c.args[1], func.params[0])}
    segments = {v: _output_segments(table, readers, v, n) for v in column}
    return Plan(column, embeddings, segments)


def _output_segments(table: dict, readers: dict, var: relax.Var, n: int) -> tuple[int, ...]:
    """The pieces a column-parallel matmul's outputs are cut into along the last axis (a split or
    slices, past elementwise ops such as the bias add), when each is divisible by ``n``."""
    width = _shape(var)[-1]
    while True:
        users_ = readers.get(var, [])
        if len(users_) != 1 or users_[0] is None:
            break
        value = table[users_[0]]
        if _op(value) not in _UNARY | _BINARY | {"relax.reshape"} or _shape(users_[0])[-1] != width:
            break
        var = users_[0]
    cuts = []
    for user in readers.get(var, []):
        value = table.get(user)
        rank = len(_shape(var))
        if _op(value) == "relax.split" and int(value.attrs.axis) % rank == rank - 1:
            cuts += [int(f.shape.values[-1]) for f in user.ty.fields]
        elif _op(value) == "relax.strided_slice" and [int(f.value) % rank for f in value.args[1].fields] \
                == [rank - 1]:
            cuts.append(_shape(user)[-1])
        else:
            return (width,)
    if sum(cuts) != width or any(c % n for c in cuts):
        return (width,)
    return tuple(cuts)


def _region(table: dict, matmuls: dict, depends: set, x: relax.Expr) -> set | None:
    """The column-parallel matmuls behind a row-parallel candidate's input ``x``, or None."""
    found, seen, stack = set(), set(), [x]
    while stack:
        var = stack.pop()
        if var in seen:
            continue
        seen.add(var)
        if var in matmuls:
            found.add(var)
            continue
        value = table.get(var)
        if value is None or (_op(value) not in _REGION_OPS
                             and not isinstance(value, (relax.Tuple, relax.TupleGetItem))):
            return None
        args = [value.tuple_value] if isinstance(value, relax.TupleGetItem) else _tensor_args(value)
        stack += [a for a in args if isinstance(a, relax.Var) and a in depends]
    return found or None


def _feeds_result(table: dict, readers: dict, var: relax.Var) -> bool:
    """``var`` reaches the function result through views / tuples only (the LM head)."""
    stack, seen = [var], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        for user in readers.get(v, []):
            if user is None:
                continue
            value = table[user]
            if not (_op(value) in _HEAD_TAIL or isinstance(value, (relax.Tuple, relax.TupleGetItem))):
                return False
            stack.append(user)
    return True


def _prod(dims) -> int:
    return math.prod(int(d) for d in dims)


def _reshape_split(src: list[int], dst: list[int], split: Split, n: int) -> Split | None:
    """Where ``split`` lands after a reshape ``src`` → ``dst`` (None: not a contiguous split)."""
    outer, a = _prod(src[: split.axis]), split.axis
    starts = [b for b in range(len(dst)) if _prod(dst[:b]) == outer and dst[b] != 1]
    if not starts:
        return None
    b = starts[0]
    if dst[b] == src[a] and _prod(dst[b + 1:]) == _prod(src[a + 1:]):
        return Split(b, split.segments)  # the axis itself is kept (other axes merge or split)
    if len(split.segments) == 1:
        return Split(b, (dst[b],)) if dst[b] % n == 0 and _prod(dst[b:]) == _prod(src[a:]) else None
    # equal segments on their own axis (3·E → (3, H, D)): the split moves to the next axis
    size = split.segments[0]
    if any(s != size for s in split.segments) or dst[b] != len(split.segments):
        return None
    rest = [c for c in range(b + 1, len(dst)) if dst[c] != 1]
    if not rest or dst[rest[0]] % n or _prod(dst[b + 1:]) != size * _prod(src[a + 1:]):
        return None
    return Split(rest[0], (dst[rest[0]],))


def _sub_segments(split: Split, begin: int, end: int) -> tuple[int, ...] | None:
    """The segments of ``split`` making up exactly ``[begin, end)`` (None: not on their bounds)."""
    bounds = np.cumsum((0, *split.segments))
    if begin not in bounds or end not in bounds:
        return None
    i, j = list(bounds).index(begin), list(bounds).index(end)
    return tuple(split.segments[i:j]) if j > i else None


@relax.expr_functor.mutator
class _Shard(relax.PyExprMutator):
    """Rank ``rank`` of ``n``: splits weights, rewrites shapes, inserts the collectives."""

    def __init__(self, mod: tvm.IRModule, plan_: Plan, table: dict, rank: int, n: int,
                 result: relax.Expr) -> None:
        super().__init__(mod)
        self.plan, self.table, self.rank, self.n, self.result = plan_, table, rank, n, result
        self.split: dict = {}  # original var → Split | tuple of (Split | None) | None
        self.rank_var: dict[str, relax.Var] = {}
        self.collectives = 0

    # --- emitting -------------------------------------------------------------------------
    def _rebind(self, binding: relax.VarBinding, value: relax.Expr) -> None:
        """Bind ``value`` to a new var of the same kind as ``binding.var`` and remap to it."""
        value = self.builder_.normalize(value)
        kind = relax.DataflowVar if isinstance(binding.var, relax.DataflowVar) else relax.Var
        new = kind(var_name(binding.var), value.ty)
        self.builder_.emit_normalized(relax.VarBinding(new, value))
        self.set_var_remap(binding.var, new)

    def _const(self, const: Constant, split: Split) -> Constant:
        return relax.const(shard_array(const.value.numpy(), split, self.rank, self.n))

    def _collective(self, name: str, x: relax.Expr, ty) -> relax.Call:
        self.collectives += 1
        return relax.call_dps_packed(name, relax.Tuple([x]), ty)

    def _gather(self, var: relax.Var) -> None:
        """Replace a split ``var`` by its all-gathered value from here on."""
        split = self.split.get(var)
        if not isinstance(split, Split) or len(split.segments) != 1:
            raise CompileError(f"compile_lm(tensor_parallel={self.n}): binding {var_name(var)!r} is "
                               f"split {split} and read by an op with no tensor-parallel rule")
        local = self.visit_expr(var)
        gathered = self.builder_.emit(self._collective(ALLGATHER, local, var.ty),
                                      name_hint=f"{var_name(var)}_gathered")
        self.set_var_remap(var, gathered)
        self.split[var] = None

    def _rank(self, dtype: str) -> relax.Var:
        if dtype not in self.rank_var:
            call = relax.call_dps_packed(RANK, relax.Tuple([]), relax.TensorType([1], dtype))
            self.rank_var[dtype] = self.builder_.emit(call, name_hint="tp_rank")
        return self.rank_var[dtype]

    # --- rules ----------------------------------------------------------------------------
    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        var, value = binding.var, binding.value
        op = _op(value)
        splits = [self.split.get(a) for a in (_tensor_args(value) if op or isinstance(value, relax.Tuple)
                                               else [])]
        if op == "relax.matmul" and _weight(self.table, value.args[1]) is not None:
            self._matmul(binding, splits[0])
        elif op == "relax.take" and var in self.plan.embeddings:
            self._embedding(binding)
        elif isinstance(value, relax.TupleGetItem):
            split = self.split.get(value.tuple_value)
            self.split[var] = split[value.index] if isinstance(split, tuple) else None
            super().visit_var_binding_(binding)
        elif isinstance(value, relax.Tuple):
            self.split[var] = tuple(splits)
            super().visit_var_binding_(binding)
        elif not any(splits):
            super().visit_var_binding_(binding)
        elif not self._split_rule(binding, op, splits):
            for arg in _tensor_args(value):
                if self.split.get(arg):
                    self._gather(arg)
            super().visit_var_binding_(binding)
        if var.same_as(self.result) and self.split.get(var):
            self._gather(var)

    def _split_rule(self, binding: relax.VarBinding, op: str | None, splits: list) -> bool:
        """Rewrite a binding with split inputs to its local form; False: no rule applies."""
        var, value = binding.var, binding.value
        first = next(s for s in splits if s)
        if not isinstance(first, Split):
            return False
        if op in _UNARY:
            self.split[var] = first
            super().visit_var_binding_(binding)
            return True
        if op in _BINARY:
            return self._binary(binding, first)
        if op == "relax.permute_dims":
            axes = [int(a) for a in value.attrs.axes] if value.attrs.axes is not None \
                else list(range(len(_shape(var))))[::-1]
            self.split[var] = Split(axes.index(first.axis), first.segments)
            super().visit_var_binding_(binding)
            return True
        if op == "relax.reshape":
            split = _reshape_split(_shape(value.args[0]), _shape(var), first, self.n)
            if split is None:
                return False
            dims = _shape(var)
            dims[split.axis] //= self.n
            self.split[var] = split
            self._rebind(binding, relax.op.reshape(self.visit_expr(value.args[0]), dims))
            return True
        if op == "relax.broadcast_to":
            src, dst = _shape(value.args[0]), _shape(var)
            axis = first.axis + len(dst) - len(src)
            if src[first.axis] != dst[axis]:
                return False
            dst[axis] //= self.n
            self.split[var] = Split(axis, first.segments)
            self._rebind(binding, relax.op.broadcast_to(self.visit_expr(value.args[0]), dst))
            return True
        if op == "relax.strided_slice":
            return self._slice(binding, first)
        if op == "relax.take":  # rows of the split tensor (the last-token logits): the split stays
            axis = int(value.attrs.axis) % len(_shape(value.args[0]))
            if axis == first.axis or self.split.get(value.args[1]) or not self.split.get(value.args[0]):
                return False
            ndim = len(_shape(value.args[1]))
            self.split[var] = Split(first.axis if first.axis < axis else first.axis - 1 + ndim,
                                    first.segments)
            super().visit_var_binding_(binding)
            return True
        if op == _ATTENTION:
            if not all(isinstance(s, Split) and s.axis == 2 and len(s.segments) == 1 for s in splits[:3]):
                return False
            self.split[var] = splits[0]
            super().visit_var_binding_(binding)
            return True
        if op == "relax.concat":
            return self._concat(binding, splits)
        if op == "relax.split":
            return self._split_op(binding, first)
        return False

    def _binary(self, binding: relax.VarBinding, first: Split) -> bool:
        var, value = binding.var, binding.value
        rank = len(_shape(var))
        axis = first.axis + rank - len(_shape(next(a for a in value.args if self.split.get(a))))
        args = []
        for arg in value.args:
            split, dims = self.split.get(arg), _shape(arg)
            at = axis - (rank - len(dims))
            if split is not None:
                if split != Split(at, first.segments):
                    return False
                args.append(self.visit_expr(arg))
            elif at < 0 or dims[at] == 1:
                args.append(self.visit_expr(arg))
            elif isinstance(arg, Constant) and dims[at] == sum(first.segments):
                args.append(self._const(arg, Split(at, first.segments)))  # a bias
            else:
                return False
        self.split[var] = Split(axis, first.segments)
        self._rebind(binding, relax.Call(value.op, args, value.attrs, value.ty_args))
        return True

    def _slice(self, binding: relax.VarBinding, first: Split) -> bool:
        var, value = binding.var, binding.value
        dims = _shape(value.args[0])
        axes, begins, ends = ([int(f.value) for f in t.fields] for t in value.args[1:4])
        strides = [int(f.value) for f in value.args[4].fields] if len(value.args) > 4 else [1] * len(axes)
        axes = [x % len(dims) for x in axes]
        if first.axis not in axes:
            self.split[var] = first
            super().visit_var_binding_(binding)
            return True
        i = axes.index(first.axis)
        size = dims[first.axis]
        begin, end = (min(max(x + (size if x < 0 else 0), 0), size) for x in (begins[i], ends[i]))
        segments = _sub_segments(first, begin, end)
        if strides[i] != 1 or segments is None:
            return False
        begins[i], ends[i] = begin // self.n, end // self.n
        self.split[var] = Split(first.axis, segments)
        self._rebind(binding, relax.op.strided_slice(self.visit_expr(value.args[0]), axes, begins, ends,
                                                     strides, assume_inbound=True))
        return True

    def _concat(self, binding: relax.VarBinding, splits: list) -> bool:
        var, value = binding.var, binding.value
        rank = len(_shape(var))
        axis = int(value.attrs.axis) % rank
        if not all(isinstance(s, Split) for s in splits):
            return False
        if all(s.axis == axis for s in splits):
            self.split[var] = Split(axis, sum((s.segments for s in splits), ()))
        elif all(s == splits[0] for s in splits):
            self.split[var] = splits[0]
        else:
            return False
        super().visit_var_binding_(binding)
        return True

    def _split_op(self, binding: relax.VarBinding, first: Split) -> bool:
        var, value = binding.var, binding.value
        axis = int(value.attrs.axis) % len(_shape(value.args[0]))
        pieces = [int(f.shape.values[axis]) for f in var.ty.fields]
        if axis != first.axis:
            self.split[var] = tuple(first for _ in pieces)
            super().visit_var_binding_(binding)
            return True
        bounds = np.cumsum((0, *pieces))
        segments = [_sub_segments(first, int(b), int(e)) for b, e in zip(bounds[:-1], bounds[1:])]
        if any(s is None for s in segments):
            return False
        self.split[var] = tuple(Split(axis, s) for s in segments)
        indices = [int(b) // self.n for b in bounds[1:-1]]
        self._rebind(binding, relax.op.split(self.visit_expr(value.args[0]), indices, axis))
        return True

    def _matmul(self, binding: relax.VarBinding, split) -> None:
        var, value = binding.var, binding.value
        const, transposed = _weight(self.table, value.args[1])
        x = value.args[0]
        rows = len(_shape(x))
        if isinstance(split, Split) and split.axis == rows - 1:  # row-parallel: contraction split
            weight = self._const(const, Split(1 if transposed else 0, split.segments))
        elif var in self.plan.column and not split:
            segments = self.plan.segments[var]
            weight = self._const(const, Split(0 if transposed else 1, segments))
            self.split[var] = Split(len(_shape(var)) - 1, segments)
        else:
            if split:
                self._gather(x)
            super().visit_var_binding_(binding)
            return
        w = relax.op.permute_dims(weight, [1, 0]) if transposed else weight
        w = self.builder_.emit(w, name_hint=f"{var_name(var)}_w")
        local = relax.op.matmul(self.visit_expr(x), w, out_dtype=value.attrs.out_dtype)
        if var in self.split:
            self._rebind(binding, local)
            return
        local = self.builder_.emit(local, name_hint=f"{var_name(var)}_partial")
        self._rebind(binding, self._collective(ALLREDUCE_SUM, local, var.ty))

    def _embedding(self, binding: relax.VarBinding) -> None:
        """``E[ids]`` → ``allreduce_sum(E_r[local] · valid)``, local = ids - rank·V/N (module doc)."""
        var, value = binding.var, binding.value
        table, ids = value.args
        rows = _shape(table)[0] // self.n
        idx = self.visit_expr(ids)
        dtype = str(ids.ty.dtype)
        emit = self.builder_.emit
        start = emit(relax.op.multiply(self._rank(dtype), relax.const(rows, dtype)))
        local = emit(relax.op.subtract(idx, start))
        valid = emit(relax.op.logical_and(relax.op.greater_equal(local, relax.const(0, dtype)),
                                          relax.op.less(local, relax.const(rows, dtype))))
        safe = emit(relax.op.where(valid, local, relax.const(0, dtype)))
        out_dtype = str(var.ty.dtype)
        got = emit(relax.op.take(self._const(table, Split(0, (_shape(table)[0],))), safe, axis=0))
        mask = emit(relax.op.astype(relax.op.expand_dims(valid, -1), out_dtype))
        partial = emit(relax.op.multiply(got, mask), name_hint=f"{var_name(var)}_partial")
        self._rebind(binding, self._collective(ALLREDUCE_SUM, partial, var.ty))


def shard_function(mod: tvm.IRModule, gv: relax.GlobalVar, rank: int, n: int) -> tuple[tvm.IRModule, int]:
    """``mod`` with function ``gv`` replaced by rank ``rank``'s shard; also its collective count."""
    func = mod[gv]
    plan_ = plan(func, n, gv.name_hint)
    rw = _Shard(mod, plan_, bindings(func), rank, n, func.body.body)
    new = rw.visit_expr(func)
    out = rw.builder_.finalize()
    out[out.get_global_var(gv.name_hint)] = new
    return out, rw.collectives


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.llm.ShardTensorParallel")
class ShardTensorParallel:
    """Every Relax function becomes rank ``rank``'s shard of ``n`` (module doc)."""

    def __init__(self, n: int, rank: int) -> None:
        if n < 1 or not 0 <= rank < n:
            raise CompileError(f"tensor_parallel={n}, rank {rank}: need n >= 1 and 0 <= rank < n")
        self.n, self.rank = n, rank

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.n == 1:
            return mod
        out = mod.clone()
        for gv, func in mod.functions.items():
            if isinstance(func, relax.Function):
                out, _ = shard_function(out, out.get_global_var(gv.name_hint), self.rank, self.n)
        return relax.transform.DeadCodeElimination()(out)


__all__ = ["Plan", "ShardTensorParallel", "Split", "plan", "shard_array", "shard_function"]
