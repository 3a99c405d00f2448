"""Remove the no-ops exporters leave behind, so the fusion patterns see the real graph.

    astype(x, dtype of x) → x        x * 1 → x        x + 0 → x    (scalar constants only)

HF models in fp32 export their mixed-precision casts as float32 → float32 Casts, and RoPE scales by
a constant 1.0: each is an extra kernel boundary and hides RMSNorm from its pattern.
Runs first among the tvmfuse passes.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

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

    func = drop_noop_casts(func)
    func = rewrite_call(one, identity(1.0), func)
    return rewrite_call(zero, identity(0.0), func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.SimplifyNoOps")
class SimplifyNoOps:
    """Drop same-dtype casts, multiplications by 1 and additions of 0."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, without_large_constants(_simplify))  # scalars stay constants
