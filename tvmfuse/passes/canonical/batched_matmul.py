"""torch.export's batched-matmul spelling → the N-D matmul it means.

torch decomposes ``a @ b`` on N-D tensors (N ≥ 3) into ``expand`` + ``view`` to 3-D + ``bmm`` +
``view`` back, which TVM imports (with tvmfuse's fp32-accumulating product converter) as::

    a3 = reshape(broadcast_to(a, (*batch, M, K)), (prod(batch), M, K))
    b3 = reshape(broadcast_to(b, (*batch, K, N)), (prod(batch), K, N))
    y  = reshape([astype](matmul(a3, b3, out_dtype), dtype), (*batch, M, N))

and this pass rewrites ``y`` into ``[astype](matmul(a', b', out_dtype), dtype)`` on the N-D
operands (``out_dtype`` and the cast kept), where ``a'`` is ``a`` when the ``broadcast_to`` is a
no-op (to its own shape) and the broadcast tensor otherwise. Shapes: a (*batch, M, K),
b (*batch, K, N), batch of rank ≥ 1, static. The 3-D matmul and its cast must have no other user
(else the product would be computed twice); N-D × 2-D products (a Linear) are left alone.

With one batch dim the reshapes are no-ops and vanish (compile_lm binds a symbolic batch), which
leaves a Linear as ``matmul(a, broadcast_to(w, (B, K, N)))`` with ``w`` (K, N) and ``a``
(B, M, K): that becomes ``matmul(a, w)`` (matmul broadcasts the 2-D operand), so the weight is not
copied per batch row (a folded constant B times the weight's size, read B times per call).

Runs in the canonicalisation stage, before any pattern pass (attention matches Q·Kᵀ and P·V on
the N-D products).
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .._util import is_op as _is_call
from .._util import rewrite_functions, static_shape, without_large_constants


def _use_counts(func: relax.Function) -> dict[relax.Var, int]:
    """How many bindings (and the function result) read each variable of ``func``."""
    uses: dict[relax.Var, int] = {}
    values = [b.value for block in func.body.blocks for b in block.bindings]
    for value in [*values, func.body.body]:
        for var in relax.analysis.free_vars(value):
            uses[var] = uses.get(var, 0) + 1
    return uses


def _batched_operand(reshaped: relax.Expr, src: relax.Expr) -> tuple[relax.Expr, list[int]] | None:
    """The N-D tensor ``src`` that ``reshaped`` (3-D) merges the batch dims of, and its batch dims.

    A ``broadcast_to`` of ``src`` to its own shape is looked through.
    """
    s3, sn = static_shape(reshaped), static_shape(src)
    if s3 is None or sn is None or len(s3) != 3 or len(sn) < 3:
        return None
    if [math.prod(sn[:-2]), *sn[-2:]] != s3:
        return None
    if _is_call(src, "relax.broadcast_to") and static_shape(src.args[0]) == sn:
        src = src.args[0]
    return src, sn[:-2]


def _fold(func: relax.Function) -> relax.Function:
    uses = _use_counts(func)
    var_of = {b.value: b.var for block in func.body.blocks for b in block.bindings}
    a, b = wildcard(), wildcard()
    mm = is_op("relax.matmul")(is_op("relax.reshape")(a, wildcard()),
                               is_op("relax.reshape")(b, wildcard()))
    cast = is_op("relax.astype")(mm)
    pattern = is_op("relax.reshape")(cast | mm, wildcard())

    def single_use(expr: relax.Expr) -> bool:
        var = var_of.get(expr)
        return var is None or uses.get(var, 0) <= 1

    def rewrite(expr: relax.Call, m) -> relax.Expr:
        product = m[mm]
        lhs = _batched_operand(product.args[0], m[a])
        rhs = _batched_operand(product.args[1], m[b])
        out = static_shape(expr)
        if lhs is None or rhs is None or out is None or lhs[1] != rhs[1]:
            return expr
        if out != [*lhs[1], *static_shape(product)[1:]]:
            return expr
        if not single_use(product) or (cast in m and not single_use(m[cast])):
            return expr
        result = relax.op.matmul(lhs[0], rhs[0], out_dtype=product.attrs.out_dtype)
        if cast in m:
            result = relax.op.astype(result, m[cast].attrs.dtype)
        return result

    return rewrite_call(pattern, rewrite, func)


def _unbroadcast_weight(func: relax.Function) -> relax.Function:
    """``matmul(a, broadcast_to(w, (*batch, K, N)))`` → ``matmul(a, w)`` for a 2-D ``w`` (K, N)
    when ``a`` has the batch dims itself (module doc)."""
    a, w = wildcard(), wildcard()
    rhs = is_op("relax.broadcast_to")(w, wildcard())
    pattern = is_op("relax.matmul")(a, rhs)

    def rewrite(expr: relax.Call, m) -> relax.Expr:
        ws, bs, as_ = static_shape(m[w]), static_shape(m[rhs]), static_shape(m[a])
        if ws is None or bs is None or as_ is None or len(ws) != 2 or len(bs) < 3:
            return expr
        if bs[-2:] != ws or as_[:-2] != bs[:-2]:
            return expr
        return relax.op.matmul(m[a], m[w], out_dtype=expr.attrs.out_dtype)

    return rewrite_call(pattern, rewrite, func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.CanonicalizeBatchedMatmul")
class CanonicalizeBatchedMatmul:
    """``reshape(matmul(reshape(a), reshape(b)))`` over merged batch dims → ``matmul(a, b)``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        # copies mod first; the products are matched by shape, never by a weight's values
        return rewrite_functions(mod, without_large_constants(lambda f: _unbroadcast_weight(_fold(f))))
