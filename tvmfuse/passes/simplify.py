"""Remove the no-ops exporters leave behind, so the fusion patterns see the real graph.

    astype(x, dtype of x) → x        x * 1 → x        x + 0 → x    (scalar constants only)
    broadcast_to(x, shape of x) → x

HF models in fp32 export their mixed-precision casts as float32 → float32 Casts, and RoPE scales by
a constant 1.0: each is an extra kernel boundary and hides RMSNorm from its pattern. A Linear on a
(B, S, K) activation with B > 1 arrives as a broadcast of x to its own shape before the 3-D matmul;
after the attention rewrite that broadcast is a copy kernel of its own (compile_lm's batch-8
decode: one per layer between the attention and the O projection).

Runs first among the tvmfuse passes.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from ..relax_shapes import known_shape, same_shape
from ._util import rewrite_functions, scalar_value, static_shape, without_large_constants


def drop_noop_casts(func: relax.Function) -> relax.Function:
    """``astype(x, dtype of x)`` → ``x`` in ``func``."""
    x = wildcard()

    def drop_cast(expr, m):
        return m[x] if str(m[x].ty.dtype) == str(expr.attrs.dtype) else expr

    return rewrite_call(is_op("relax.astype")(x), drop_cast, func)


def _simplify(func: relax.Function) -> relax.Function:
    x, c = wildcard(), is_const()
    one = is_op("relax.multiply")(x, c) | is_op("relax.multiply")(c, x)
    zero = is_op("relax.add")(x, c) | is_op("relax.add")(c, x)

    def identity(value: float):
        def rewrite(expr, m):
            same = static_shape(m[x]) == static_shape(expr) and str(m[x].ty.dtype) == str(expr.ty.dtype)
            return m[x] if same and scalar_value(m[c]) == value else expr

        return rewrite

    def drop_broadcast(expr, m):
        same = known_shape(m[x]) is not None and same_shape(known_shape(m[x]), known_shape(expr))
        return m[x] if same else expr

    func = drop_noop_casts(func)
    func = rewrite_call(is_op("relax.broadcast_to")(x, wildcard()), drop_broadcast, func)
    func = rewrite_call(one, identity(1.0), func)
    return rewrite_call(zero, identity(0.0), func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.SimplifyNoOps")
class SimplifyNoOps:
    """Drop same-dtype casts, broadcasts to the operand's own shape, multiplications by 1 and
    additions of 0."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, without_large_constants(_simplify))  # scalars stay constants
