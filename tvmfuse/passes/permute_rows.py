"""Row permutations move through Linears: ``nn.MultiheadAttention`` without transpose kernels.

torch's ``nn.MultiheadAttention`` (``batch_first=True``, so also ``nn.TransformerEncoderLayer``)
works sequence-first inside, so torch.export writes its body between two batch/sequence swaps::

    t   = permute_dims(x, [1, 0, 2])                                   (B, S, E) → (S, B, E)
    qkv = reshape(matmul(reshape(t, (S·B, E)), W) + b, (S, B, 3E))     → views → attention q, k, v
    o   = reshape(permute_dims(att, [1, 0, 2, 3]), (S·B, E))           att (B, S, H, D)
    y   = permute_dims(reshape(matmul(o, Wo) + bo, (S, B, E)), [1, 0, 2])

Each swap is a copy kernel of its own (the input's, and the output's before the residual add),
and the attention result is transposed once more. A Linear maps rows independently, so a
permutation ``p`` of the leading (row) axes commutes with it and with a row-wise chain ``f`` after
it (casts; bias, scale or activation ops whose other operand has no row axis). Two rewrites, each
where every value between the two ends has one reader:

* input side: ``reshape(f(matmul(reshape(permute_dims(x, p), (R, K)), W)), L_p + T)``
  → ``permute_dims(reshape(f(matmul(reshape(x, (R, K)), W)), L_x + T), p + identity)``,
  only where that result reaches nothing but attention operands through views: there the
  attention's pack kernel takes the permutation into its loads (elsewhere it would turn a K-wide
  copy into an N-wide one);
* output side: ``permute_dims(reshape(f(matmul(reshape(z, (R, K)), W)), L + T), p)``
  → ``reshape(f(matmul(reshape(w, (R, K)), W)), L_p + T)`` where ``z = permute_dims(w, s)`` and
  ``s`` followed by ``p`` is the identity: the Linear reads the attention's result in its own
  layout, and its epilogue meets the residual add; where that permutation moves only size-1 axes
  (batch 1, where the other swaps were already views) it becomes a reshape.

Static shapes only. Sits after FuseAttention (which matches the attention through the swaps) and
before HorizontalGemm / NormGemmPrologue (a pre-LN block's norm then meets its Linear directly).
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..relax_shapes import shape_expr, static_shape
from ._util import binding_users, dataflow_bindings, is_op, op_name, rewrite_with_plans
from .sink_reshape import BINARY, UNARY, last_axis_broadcast

NAME = "permute_rows"
_ATTENTION = ("relax.nn.attention", "relax.nn.attention_bias")
# ops that only move or pick elements (what the attention pack kernel reads through)
_VIEWS = ("relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze",
          "relax.take", "relax.strided_slice", "relax.split", "relax.astype", "relax.broadcast_to")


@dataclasses.dataclass
class _Gemm:
    """``end = f(matmul(reshape(src, (R, K)), w))``: the chain's ops from the matmul up."""

    src: relax.Expr  # what the row reshape reads
    matmul: relax.Call
    chain: list  # (op call, position of the chain operand) after the matmul, in order


def _single_reader(var, users: dict) -> bool:
    readers = users.get(var, [])
    return len(readers) == 1 and readers[0] is not None


def _gemm_chain(end: relax.Expr, bound: dict, users: dict) -> _Gemm | None:
    """The Linear and row-wise chain that compute ``end`` (every value read only by the next op)."""
    chain = []
    expr = end
    for _ in range(8):
        if not isinstance(expr, relax.Var) or expr not in bound:
            return None
        if not _single_reader(expr, users):
            return None
        value = bound[expr]
        name = op_name(value)
        if name == "relax.matmul":
            a, w = value.args
            a_value = bound.get(a) if isinstance(a, relax.Var) else None
            w_shape, a_shape = static_shape(w), static_shape(a)
            if (not is_op(a_value, "relax.reshape") or w_shape is None or len(w_shape) != 2
                    or a_shape is None or len(a_shape) != 2 or not _single_reader(a, users)):
                return None
            return _Gemm(a_value.args[0], value, chain[::-1])
        if name in UNARY:
            chain.append((value, 0))
            expr = value.args[0]
            continue
        shape = static_shape(value)
        if name in BINARY and shape is not None and len(shape) == 2:
            for pos in (0, 1):  # the chain operand (rows); the other broadcasts along the last axis
                o_shape = static_shape(value.args[1 - pos])
                if (static_shape(value.args[pos]) == shape and o_shape is not None
                        and len(o_shape) <= 2 and last_axis_broadcast(o_shape, shape[-1])):
                    chain.append((value, pos))
                    expr = value.args[pos]
                    break
            else:
                return None
            continue
        return None
    return None


def _through_broadcasts(expr: relax.Expr, bound: dict) -> relax.Expr:
    """``x`` for ``broadcast_to(x, shape of x)`` (any depth), else ``expr``."""
    while isinstance(expr, relax.Var) and is_op(bound.get(expr), "relax.broadcast_to"):
        inner = bound[expr].args[0]
        if static_shape(inner) != static_shape(expr):
            break
        expr = inner
    return expr


def _permute_of(expr: relax.Expr, bound: dict) -> tuple[relax.Expr, list[int]] | None:
    """``(x, axes)`` when ``expr`` is bound to ``permute_dims(x, axes)`` with explicit axes."""
    value = bound.get(expr) if isinstance(expr, relax.Var) else None
    if not is_op(value, "relax.permute_dims") or value.attrs.axes is None:
        return None
    return value.args[0], [int(a) for a in value.attrs.axes]


def _leading(shape: list[int], k: int) -> list[int] | None:
    """The leading axes of ``shape`` whose product is the rows when the trailing ones make ``k``."""
    prod = 1
    for i in range(len(shape), 0, -1):
        if prod == k:
            return shape[:i]
        prod *= shape[i - 1]
    return None


def _order_kept(axes: list[int], shape: list[int]) -> bool:
    """``permute_dims(., axes)`` of a ``shape`` tensor keeps the order of its non-unit axes
    (only size-1 axes move): the same elements in the same order, a reshape."""
    moved = [a for a in axes if shape[a] != 1]
    return moved == sorted(moved)


def _feeds_only_attention(var, bound: dict, users: dict) -> bool:
    """Every path from ``var`` goes through views into an attention's q, k or v."""
    seen, todo = set(), [var]
    while todo:
        v = todo.pop()
        for reader in users.get(v, []):
            if reader is None:
                return False
            name = op_name(bound.get(reader))
            if name in _ATTENTION:
                if any(a.same_as(v) for a in bound[reader].args[3:]):
                    return False  # a bias or mask, not q / k / v
                continue
            if name not in _VIEWS and not isinstance(bound.get(reader), relax.TupleGetItem):
                return False
            if reader not in seen:
                seen.add(reader)
                todo.append(reader)
    return True


@dataclasses.dataclass
class _Rewrite:
    gemm: _Gemm | None  # None: the value is ``reshape(src, out_shape)`` (no Linear rebuilt)
    src: relax.Expr  # the new row reshape's input
    out_shape: list[int]  # the reshape after the chain
    permute: list[int] | None  # applied to that reshape's result (input side)


def _plan(func: relax.Function) -> dict:
    bound, _ = dataflow_bindings(func)
    users = binding_users(func)
    plans = {}
    for var, value in bound.items():
        # input side: var = reshape(f(matmul(reshape(permute_dims(x, p)))), L_p + T)
        if is_op(value, "relax.reshape"):
            gemm = _gemm_chain(value.args[0], bound, users)
            perm = _permute_of(_through_broadcasts(gemm.src, bound), bound) if gemm else None
            out = static_shape(value)
            if perm is None or out is None:
                continue
            x, p = perm
            x_shape = static_shape(x)
            k = static_shape(gemm.matmul.args[0])[1]
            n = len(x_shape or [])
            lead = len(x_shape) - 1 if x_shape and x_shape[-1] == k else None
            if lead is None or p[-1] != n - 1 or sorted(p) != list(range(n)):
                continue
            permuted = [x_shape[i] for i in p[:-1]]
            if out[:lead] != permuted or not _feeds_only_attention(var, bound, users):
                continue
            trailing = len(out) - lead
            plans[var] = _Rewrite(gemm, x, x_shape[:-1] + out[lead:],
                                  p[:-1] + [lead + i for i in range(trailing)])
        # output side: var = permute_dims(reshape(f(matmul(reshape(z))), L + T), p), z = permute(w, s)
        elif is_op(value, "relax.permute_dims") and value.attrs.axes is not None:
            r = value.args[0]
            r_value = bound.get(r) if isinstance(r, relax.Var) else None
            if not is_op(r_value, "relax.reshape") or not _single_reader(r, users):
                continue
            gemm = _gemm_chain(r_value.args[0], bound, users)
            if gemm is None:
                continue
            p, r_shape = [int(a) for a in value.attrs.axes], static_shape(r)
            if r_shape is not None and _order_kept(p, r_shape):
                # only size-1 axes move (batch 1): a view, which SinkReshape then moves below
                # the epilogue (the residual add)
                plans[var] = _Rewrite(None, r, static_shape(value), None)
                continue
            z = _through_broadcasts(gemm.src, bound)
            perm = _permute_of(z, bound)
            p = [int(a) for a in value.attrs.axes]
            r_shape, out = static_shape(r), static_shape(value)
            k = static_shape(gemm.matmul.args[0])[1]
            if perm is None or r_shape is None or out is None:
                continue
            w, s = perm
            z_shape = static_shape(z)
            lead = _leading(z_shape, k) if z_shape else None
            if lead is None or r_shape[:len(lead)] != lead:
                continue
            m = len(lead)
            if any(p[i] != i for i in range(m, len(p))) or sorted(p[:m]) != list(range(m)):
                continue
            p_z = p[:m] + list(range(m, len(z_shape)))
            if [s[i] for i in p_z] != list(range(len(s))):
                continue  # the permutations do not cancel: keep the copy where it is
            plans[var] = _Rewrite(gemm, w, out, None)
    return plans


@mutator
class _Move(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, plans: dict) -> None:
        super().__init__(mod)
        self.plans = plans

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        plan = self.plans.get(binding.var)
        if plan is None:
            super().visit_var_binding_(binding)
            return
        g = plan.gemm
        if g is None:
            value = relax.op.reshape(self.visit_expr(plan.src), shape_expr(plan.out_shape))
            self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(value)))
            return
        emit = self.builder_.emit
        rows = emit(relax.op.reshape(self.visit_expr(plan.src), g.matmul.args[0].ty.shape))
        y = emit(relax.Call(g.matmul.op, [rows, self.visit_expr(g.matmul.args[1])], g.matmul.attrs))
        for call, pos in g.chain:
            args = [self.visit_expr(a) for a in call.args]
            args[pos] = y
            y = emit(relax.Call(call.op, args, call.attrs))
        if plan.permute is None:
            value = relax.op.reshape(y, shape_expr(plan.out_shape))
        else:
            y = emit(relax.op.reshape(y, shape_expr(plan.out_shape)))
            value = relax.op.permute_dims(y, plan.permute)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(value)))


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.PermuteRowsThroughGemm")
class PermuteRowsThroughGemm:
    """Leading-axis permutations move through Linears (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_with_plans(mod, _plan, _Move)
