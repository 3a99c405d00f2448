"""View chains before a reshape → at most one permute and the reshape.

torch.export writes ``torch.einsum`` as 5-D views around the 3-D ``bmm``: each operand is
``expand_dims``-ed to one axis per einsum letter, permuted (often twice) into (batch, free,
contracted, size-1 ...) order and reshaped to 3-D; the product is reshaped to 5-D, permuted and
reshaped to 4-D. Only the order of the axes that are not size 1 matters to a reshape, so::

    reshape(v_1(v_2(... v_n(x))), s)  →  reshape(permute_dims(x, P), s)   (or reshape(x, s), or x)

where each ``v_i`` is ``reshape``, ``expand_dims``, ``squeeze`` or ``permute_dims``. Walking down
from the reshape, reshapes and permutes that keep the order of the non-unit axes are dropped (the
row-major order the reshape reads is unchanged); from the first permute that moves a non-unit axis
on, permutes are composed and size-1 axes dropped (``expand_dims``, ``squeeze``, reshapes that only
add or remove size-1 axes) into one permutation ``P`` of ``x``'s non-unit axes (its size-1 axes stay
in place). A reshape that splits or merges axes ends the walk; when the permuted result is the
final shape, its size-1 axes are replaced by those of the final shape (the 3-D product → 5-D →
permute → 4-D becomes 3-D → 4-D → permute). A batched product's result (``matmul`` of ≥ 3-D
operands, or its cast) is reshaped only into its N-D form, the one
:class:`CanonicalizeBatchedMatmul` folds. Shapes: static, any rank. Every view on the way must have
no other user; the chain is rewritten only when a permute or size-1 view goes away (or the split
loses its size-1 axes): ``reshape(reshape(x))`` alone is left to RemoveRedundantReshape.

For ``einsum("bhqd,bhkd->bhqk", q, k)`` this leaves ``reshape(q, (B·H, Sq, D))``,
``reshape(permute_dims(k, [0, 1, 3, 2]), (B·H, D, Skv))`` and ``reshape(scores3, (B, H, Sq, Skv))``:
the spelling :class:`CanonicalizeBatchedMatmul` turns into the 4-D matmul. Runs in the
canonicalisation stage, before :class:`CanonicalizeBatchedMatmul`.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .._util import rewrite_functions, shape_expr, static_shape, without_large_constants

_VIEWS = ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.permute_dims")


def _op(expr: relax.Expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def _non_unit(shape: list[int]) -> list[int]:
    return [d for d in shape if d != 1]


def _axes(call: relax.Call, ndim: int) -> list[int]:
    """A permute's axes (None: reversed)."""
    axes = call.attrs.axes
    return [int(a) for a in axes] if axes is not None else list(range(ndim))[::-1]


def _keeps_order(call: relax.Call, ndim: int, shape: list[int]) -> bool:
    """A permute of a tensor of ``shape`` that keeps its non-unit axes in order."""
    moved = [a for a in _axes(call, ndim) if shape[a] != 1]
    return moved == sorted(moved)


class _Chains:
    """Binding table and use counts of one function; rewrites one reshape at a time."""

    def __init__(self, func: relax.Function) -> None:
        self.table: dict[relax.Var, relax.Expr] = {}
        self.uses: dict[relax.Var, int] = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding, relax.VarBinding):
                    self.table[binding.var] = binding.value
        for value in [*self.table.values(), func.body.body]:
            for var in relax.analysis.free_vars(value):
                self.uses[var] = self.uses.get(var, 0) + 1

    def _view(self, expr: relax.Expr) -> relax.Call | None:
        """The view op bound to ``expr`` when ``expr`` is a single-use var with a static shape."""
        value = self.table.get(expr) if isinstance(expr, relax.Var) else None
        if _op(value) not in _VIEWS or self.uses.get(expr, 0) != 1:
            return None
        if static_shape(expr) is None or static_shape(value.args[0]) is None:
            return None
        return value

    def _product(self, expr: relax.Expr) -> bool:
        """``expr`` is a batched product (``matmul`` of ≥ 3-D operands) or a cast of one."""
        value = self.table.get(expr) if isinstance(expr, relax.Var) else None
        if _op(value) == "relax.astype":
            value = self.table.get(value.args[0]) if isinstance(value.args[0], relax.Var) else None
        return _op(value) == "relax.matmul" and all(len(static_shape(a) or []) >= 3 for a in value.args)

    def rewrite(self, reshape: relax.Call) -> relax.Expr:
        out = static_shape(reshape)
        if out is None:
            return reshape
        # 1. views the reshape absorbs: reshapes and order-keeping permutes; a batched product's
        #    reshape only into its N-D form (what CanonicalizeBatchedMatmul folds)
        expr, dropped, reshapes = reshape.args[0], 0, 0
        while (view := self._view(expr)) is not None:
            src = static_shape(view.args[0])
            if _op(view) == "relax.permute_dims" and not _keeps_order(view, len(src), src):
                break
            if _op(view) == "relax.reshape" and self._product(view.args[0]) and not _unfolds(src, out):
                break
            expr, dropped, reshapes = view.args[0], dropped + 1, reshapes + (_op(view) == "relax.reshape")
        view = self._view(expr)
        if view is None or _op(view) != "relax.permute_dims":  # no permute to compose
            # reshape(reshape(x)) alone is RemoveRedundantReshape's, later in the pipeline
            return reshape if dropped == reshapes else _reshape(expr, out)
        # 2. from the first permute that moves a non-unit axis: permutes and size-1 axes only
        chain = []
        while (view := self._view(expr)) is not None:
            src, dst = static_shape(view.args[0]), static_shape(expr)
            if _op(view) == "relax.reshape" and (_non_unit(src) != _non_unit(dst)
                                                 or self._product(view.args[0])):
                break
            chain.append(view)
            expr = view.args[0]
        start = static_shape(expr)
        labels = _labels(chain, start)
        base, shape, absorbed = expr, start, False
        if view is not None and 1 in start and _non_unit(out) == [_non_unit(start)[x] for x in labels]:
            # a reshape that also splits or merges axes (the 3-D product → 5-D) stays, with the
            # size-1 axes of ``out`` instead of its own: the permute then gives ``out`` itself
            order = iter(sorted(labels))
            split = [1 if d == 1 else _non_unit(start)[next(order)] for d in out]
            src = static_shape(view.args[0])
            if not self._product(view.args[0]) or _unfolds(src, split):
                base, shape = relax.op.reshape(view.args[0], shape_expr(split)), split
                absorbed = True
        slots = [i for i, d in enumerate(shape) if d != 1]
        perm = list(range(len(shape)))
        for slot, label in zip(slots, labels, strict=True):
            perm[slot] = slots[label]
        kept = 0 if perm == sorted(perm) else 1
        final = [shape[p] for p in perm] != out
        # rewritten when permutes / size-1 views go away, or the split loses its size-1 axes
        saved = dropped - reshapes + len(chain) - kept
        if saved <= 0 and not (absorbed and kept + final < dropped + len(chain) + 1):
            return reshape
        result = base if not kept else relax.op.permute_dims(base, perm)
        return relax.op.reshape(result, shape_expr(out)) if final else result


def _unfolds(src: list[int], out: list[int]) -> bool:
    """``out`` is ``src`` (batch, M, N) with its batch dims split: the N-D product's shape."""
    return len(out) >= 3 and out[-2:] == src[-2:] and math.prod(out[:-2]) == math.prod(src[:-2])


def _reshape(expr: relax.Expr, out: list[int]) -> relax.Expr:
    return expr if static_shape(expr) == out else relax.op.reshape(expr, shape_expr(out))


def _labels(chain: list[relax.Call], start: list[int]) -> list[int]:
    """The order in which ``chain`` (outermost first; permutes, size-1 axes coming and going)
    leaves the non-unit axes of a tensor of shape ``start``: their ordinals, outermost order."""
    ordinal = iter(range(len(start)))
    labels: list[int | None] = [None if d == 1 else next(ordinal) for d in start]
    for view in reversed(chain):
        if _op(view) == "relax.permute_dims":
            labels = [labels[a] for a in _axes(view, len(labels))]
        else:  # expand_dims, squeeze, reshape: only size-1 axes come and go
            order = iter(x for x in labels if x is not None)
            labels = [None if d == 1 else next(order) for d in static_shape(view)]
    return [x for x in labels if x is not None]


def _collapse(func: relax.Function) -> relax.Function:
    chains = _Chains(func)
    pattern = is_op("relax.reshape")(wildcard(), wildcard())
    func = rewrite_call(pattern, lambda expr, _m: chains.rewrite(expr), func)
    return relax.analysis.remove_all_unused(func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.CollapseViewChains")
class CollapseViewChains:
    """``reshape(views(x))`` → ``reshape([permute_dims](x))``: size-1 axes dropped, permutes composed."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, without_large_constants(_collapse))  # views only: weights lifted
