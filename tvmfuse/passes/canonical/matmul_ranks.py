"""Batched products whose operands differ in rank → both operands of the same rank (a view).

    matmul(a, b)    a (1, H, M, K), b (H, K, N)   →   matmul(a, reshape(b, (1, H, K, N)))

``matmul`` broadcasts the batch dims of the lower-rank operand as if it had leading unit axes.
The ONNX optimiser of torch's dynamo exporter leaves such pairs behind when it folds the
reshapes of a heads-folded attention (``bmm`` on (B·H, S, D) at batch 1: q stays
(1, H, S, D), kᵀ becomes (H, D, S)); the attention pattern wants two 4-D operands. Only
operands of rank ≥ 3 with static shapes are aligned (an N-D × 2-D product is a Linear, left as
it is). Any position in the canonical list, before the pattern passes.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .._util import rewrite_functions, shape_expr, static_shape


def _rewrite(func: relax.Function) -> relax.Function:
    a, b = wildcard(), wildcard()
    pattern = is_op("relax.matmul")(a, b)

    def rewriter(expr: relax.Call, m) -> relax.Expr:
        x, y = m[a], m[b]
        sx, sy = static_shape(x), static_shape(y)
        if sx is None or sy is None or min(len(sx), len(sy)) < 3 or len(sx) == len(sy):
            return expr
        rank = max(len(sx), len(sy))
        x, y = (t if len(s) == rank else relax.op.reshape(t, shape_expr([1] * (rank - len(s)) + s))
                for t, s in ((x, sx), (y, sy)))
        return relax.op.matmul(x, y, out_dtype=expr.attrs.out_dtype)

    return rewrite_call(pattern, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.MatmulRanks")
class MatmulRanks:
    """Batched ``matmul`` of a rank-r and a rank-(<r) operand → the latter with leading unit axes."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _rewrite)
