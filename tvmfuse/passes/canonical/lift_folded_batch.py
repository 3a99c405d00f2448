"""Batched products on heads-folded 3-D tensors, and the chain between them → N-D.

Attention written on (B·H, S, D) tensors (GPT-NeoX's ``_attn``: ``torch.baddbmm`` for the scores,
``torch.bmm`` for P·V) folds the batch dims of every operand into one::

    q3 = reshape(q, (B·H, Sq, D))        ...   k3, v3 likewise; kᵀ as permute_dims(k3, [0, 2, 1])
    s3 = f(matmul(q3, kᵀ3), bias3, ...)  (G, Sq, Skv) elementwise / softmax ops, G = B·H
    o  = reshape(matmul(p3, v3), (B, H, Sq, D))

This pass computes that region on the unfolded tensors instead: a *folded* value is a 3-D
``reshape(x, (prod(bd), a, b))`` of an N-D ``x`` of shape (*bd, a, b) (``bd``: the batch dims,
at least two), or an op on folded values: ``matmul`` (both operands folded), ``permute_dims``
that keeps axis 0, ``softmax`` / ``log_softmax`` over a non-batch axis, ``astype``, elementwise
unary / binary ops and ``where``. Their other operands must broadcast the same way over (*bd, a, b)
as over (G, a, b): scalars, rank ≤ 2, rank 3 with a leading 1, or ``full`` / ``zeros`` / ``ones`` /
``broadcast_to`` of such a value to (G, a, b) (rebuilt with shape (*bd, a, b)); or, in an
elementwise op, a per-batch tensor (G, a', b') (Bloom's ALiBi bias (B·H, 1, S)), which is reshaped
to (*bd, a', b'). Each folded value becomes the same op on the unfolded operands, and
``reshape(folded, (*bd, a, b))`` becomes the unfolded value. At batch 1 exporters also fold
without a reshape: XGLM's ``(S, H, D)`` view transposed to ``(H, S, D)`` (``permute_dims(r,
[1, 0, 2])``) is taken as folded from the ``(1, H, S, D)`` tensor ``permute_dims(reshape(r,
(1, S, H, D)), [0, 2, 1, 3])``. Every value lifted must have only lifted users or such reshapes
(nothing is computed twice), and the region must hold a batched product; the rewrite moves no data, it
only names the batch axes (so the attention pattern sees (B, H, S, S) scores).

Runs in the canonicalisation stage, after :class:`CanonicalizeBatchedMatmul` (which handles a
lone product between reshapes) and before any pattern pass.
"""

from __future__ import annotations

import functools
import math

import tvm
from tvm import relax

from .._util import rewrite_functions, shape_expr, static_shape

_ELEMENTWISE = {
    "relax.astype", "relax.exp", "relax.negative", "relax.sqrt", "relax.rsqrt", "relax.tanh",
    "relax.sigmoid", "relax.abs", "relax.log", "relax.square", "relax.erf",
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum",
    "relax.minimum", "relax.power", "relax.where",
}
_SOFTMAX = ("relax.nn.softmax", "relax.nn.log_softmax")
_FILLS = ("relax.full", "relax.zeros", "relax.ones")  # shape is the first argument


def _op(expr: relax.Expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def _emit(bb: relax.BlockBuilder, bindings: list, expr: relax.Expr) -> relax.Var:
    """Bind ``expr`` to a new dataflow var appended to ``bindings``."""
    new = relax.DataflowVar("unfolded", bb.normalize(expr).ty)
    bindings.append(relax.VarBinding(new, expr))
    return new


def _per_batch(shape: list[int] | None) -> bool:
    """A rank-3 tensor with a batch axis of its own (G > 1, a per-head bias such as ALiBi)."""
    return shape is not None and len(shape) == 3 and shape[0] > 1


def _unbatched(shape: list[int] | None) -> bool:
    """A tensor that broadcasts alike against (G, a, b) and (*bd, a, b): rank ≤ 2 or (1, a, b)."""
    return shape is not None and (len(shape) <= 2 or (len(shape) == 3 and shape[0] == 1))


class _Lift:
    """Finds the folded region of one function and rebuilds it unfolded."""

    def __init__(self, func: relax.Function) -> None:
        self.func = func
        self.table: dict[relax.Var, relax.Expr] = {}
        self.users: dict[relax.Var, list[relax.Var | None]] = {}  # None: a use outside dataflow
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(block, relax.DataflowBlock) and isinstance(binding, relax.VarBinding):
                    self.table[binding.var] = binding.value
        for block in func.body.blocks:
            for binding in block.bindings:
                user = binding.var if binding.var in self.table else None
                for var in relax.analysis.free_vars(binding.value):
                    self.users.setdefault(var, []).append(user)
        for var in relax.analysis.free_vars(func.body.body):
            self.users.setdefault(var, []).append(None)
        self.seeds: dict[relax.Var, tuple[relax.Expr | None, tuple[int, ...]]] = {}  # var → (x, bd)
        self.head_views: dict[relax.Var, relax.Expr] = {}  # seed → the (S, H, D) tensor it transposes
        # var → its batch dims bd, or None while it is free (computed from fills and broadcasts
        # only; its bd comes from its users)
        self.region: dict[relax.Var, tuple[int, ...] | None] = {}
        self.sinks: dict[relax.Var, relax.Var] = {}  # reshape(folded, (*bd, a, b)) → folded

    # --- which values are folded ----------------------------------------------------------------

    def _seed(self, value: relax.Call, out: list[int]) -> tuple[int, ...] | None:
        src = static_shape(value.args[0])
        if src is None or len(src) < 4 or src[-2:] != out[1:] or math.prod(src[:-2]) != out[0]:
            return None
        return tuple(src[:-2])

    def _batch(self, value: relax.Call) -> tuple[str, tuple[int, ...] | None] | None:
        """``("folded", bd)`` when the folded operands share batch dims bd, ``("free", None)`` for
        an elementwise op on free and unbatched operands only, else None."""
        op, bds, free, groups = _op(value), set(), False, set()
        for arg in value.args:
            if arg in self.seeds:
                bds.add(self.seeds[arg][1])
            elif self.region.get(arg) is not None:
                bds.add(self.region[arg])
            elif op == "relax.matmul":
                return None
            elif arg in self.region:
                free = True
            elif _per_batch(static_shape(arg)):
                groups.add(static_shape(arg)[0])
            elif not _unbatched(static_shape(arg)):
                return None
        if len(bds) == 1:
            bd = bds.pop()
            if groups and (op not in _ELEMENTWISE or groups != {math.prod(bd)}):
                return None
            return "folded", bd
        return ("free", None) if not bds and not groups and free and op in _ELEMENTWISE else None

    def _classify(self, var: relax.Var, value: relax.Expr) -> None:
        op, out = _op(value), static_shape(var)
        if op is None or out is None:
            return
        arg = value.args[0] if value.args else None
        if op == "relax.reshape":
            bd = self._seed(value, out) if len(out) == 3 else None
            if bd is not None:
                self.seeds[var] = (arg, bd)
            elif self.region.get(arg) is not None and out == [*self.region[arg], *out[-2:]]:
                self.sinks[var] = arg
            return
        if len(out) != 3:
            return
        if (op == "relax.permute_dims" and value.attrs.axes is not None
                and [int(a) for a in value.attrs.axes] == [1, 0, 2]
                and arg not in self.seeds and arg not in self.region):
            self.seeds[var], self.head_views[var] = (None, (1, out[0])), arg  # batch 1, squeezed
            return
        if op in _FILLS or (op == "relax.broadcast_to" and _unbatched(static_shape(arg))):
            self.region[var] = None
            return
        found = self._batch(value)
        if found is None:
            return
        if op == "relax.permute_dims" and (value.attrs.axes is None or int(value.attrs.axes[0]) != 0):
            return
        if op in _SOFTMAX and int(value.attrs.axis) % 3 == 0:
            return
        if op in ("relax.matmul", "relax.permute_dims", *_SOFTMAX) or op in _ELEMENTWISE:
            self.region[var] = found[1]

    def _closed(self, var: relax.Var) -> bool:
        """Every user of ``var`` is in the region or unfolds it, and so are its operands."""
        for user in self.users.get(var, []):
            sink = self.sinks.get(user) if user is not None else None
            if user not in self.region and (sink is None or not sink.same_as(var)):
                return False
        value = self.table[var]
        if _op(value) in (*_FILLS, "relax.broadcast_to"):
            return True
        found = self._batch(value)
        return found is not None and found[1] == self.region[var]

    def _close(self) -> None:
        """Shrink the region until it is closed and each free value gets its users' batch dims."""
        while True:
            open_ = [v for v in self.region if not self._closed(v)]
            for var in open_:
                del self.region[var]
            if open_:
                continue
            resolved: dict[relax.Var, tuple[int, ...]] = {}
            for var in reversed(self.table):
                if var in self.region and self.region[var] is None:
                    bds = {resolved.get(u, self.region[u]) for u in self.users.get(var, [])}
                    if len(bds) != 1 or None in bds:
                        del self.region[var]  # users with different batch dims: leave it folded
                        break
                    resolved[var] = bds.pop()
            else:
                self.region.update(resolved)
                break
        self.sinks = {s: v for s, v in self.sinks.items() if v in self.region}

    # --- the rewrite ----------------------------------------------------------------------------

    def _new_value(self, var: relax.Var, remap: dict[relax.Var, relax.Expr],
                   emit) -> relax.Expr:
        value = self.table[var]
        op = _op(value)
        bd = list(self.region[var])
        if op in _FILLS or op == "relax.broadcast_to":
            shape = shape_expr([*bd, *static_shape(var)[1:]])
            if op == "relax.broadcast_to":
                return relax.op.broadcast_to(value.args[0], shape)
            return relax.Call(value.op, [shape, *value.args[1:]], value.attrs)
        args = [remap.get(a, a) for a in value.args]
        if op in _ELEMENTWISE:  # per-batch operands (G, a', b') → (*bd, a', b')
            args = [emit(relax.op.reshape(a, shape_expr([*bd, *static_shape(a)[1:]])))
                    if a not in remap and _per_batch(static_shape(a)) else a for a in args]
        nb = len(bd)
        if op == "relax.permute_dims":
            axes = [int(a) for a in value.attrs.axes]
            return relax.op.permute_dims(args[0], [*range(nb), *(nb - 1 + a for a in axes[1:])])
        if op in _SOFTMAX:
            axis = int(value.attrs.axis)
            make = relax.op.nn.softmax if op == "relax.nn.softmax" else relax.op.nn.log_softmax
            return make(args[0], axis if axis < 0 else axis + nb - 1)
        return relax.Call(value.op, args, value.attrs)

    def run(self) -> relax.Function:
        for var, value in self.table.items():
            self._classify(var, value)
        self._close()
        if not any(_op(self.table[v]) == "relax.matmul" for v in self.region):
            return self.func
        bb = relax.BlockBuilder()
        remap: dict[relax.Var, relax.Expr] = {v: x for v, (x, _) in self.seeds.items() if x is not None}
        blocks = []
        for block in self.func.body.blocks:
            bindings: list[relax.Binding] = []
            emit = functools.partial(_emit, bb, bindings)
            for binding in block.bindings:
                var = binding.var
                if var in self.head_views:  # (S, H, D) → (1, S, H, D) → (1, H, S, D)
                    s_, h, d = static_shape(self.head_views[var])
                    x4 = emit(relax.op.reshape(self.head_views[var], shape_expr([1, s_, h, d])))
                    remap[var] = emit(relax.op.permute_dims(x4, [0, 2, 1, 3]))
                elif var in self.region:
                    value = bb.normalize(self._new_value(var, remap, emit))
                    new = relax.DataflowVar(str(var.name), value.ty)
                    remap[var] = new
                    binding = relax.VarBinding(new, value)
                elif var in self.sinks:
                    binding = relax.VarBinding(var, remap[self.sinks[var]])
                bindings.append(binding)
            blocks.append(relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock)
                          else relax.BindingBlock(bindings))
        f = self.func
        func = relax.Function(f.params, relax.SeqExpr(blocks, f.body.body), f.ret_ty, f.is_pure,
                              f.attrs, f.span)
        func = relax.transform.CanonicalizeBindings()(tvm.IRModule({"f": func}))["f"]  # sink aliases
        return relax.analysis.remove_all_unused(func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.LiftFoldedBatch")
class LiftFoldedBatch:
    """Ops on (prod(bd), a, b) reshapes of (*bd, a, b) tensors, batched products among them → N-D."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, lambda f: _Lift(f).run())  # copies mod before assigning
