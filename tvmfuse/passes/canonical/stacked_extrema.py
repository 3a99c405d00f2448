"""ONNX's n-ary Max / Min, as TVM's importer writes them, → elementwise ``maximum`` / ``minimum``.

    max(stack([broadcast_to(a, s), broadcast_to(c, s)], axis=0), axis=[0])     s: the out shape
      → maximum(a, c)                               (a of shape s, c a scalar or broadcastable)

TVM 0.27's ONNX frontend imports ``Max(a, b, …)`` by broadcasting every input to the common shape,
stacking them and reducing over the new axis: a copy of each input and a reduction where one
elementwise op would do, and a spelling no pattern pass knows (XGLM's ``torch.max(scores,
finfo.min)`` clamp before the softmax, exported to ONNX, left the attention unfused). A
``broadcast_to`` is dropped where some operand already has the output shape (the elementwise op
broadcasts the rest); otherwise the broadcasts stay. Any position in the canonical list, before
the pattern passes.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .._util import dataflow_bindings, rewrite_functions, static_shape
from .._util import is_op as _is_call

_ELEMENTWISE = {"relax.max": relax.op.maximum, "relax.min": relax.op.minimum}


def _rewrite(func: relax.Function) -> relax.Function:
    stack = is_op("relax.stack")(wildcard())
    pattern = is_op("relax.max")(stack) | is_op("relax.min")(stack)
    bound, _ = dataflow_bindings(func)

    def unbroadcast(x: relax.Expr, shape: list[int]) -> relax.Expr:
        value = bound.get(x, x)
        if _is_call(value, "relax.broadcast_to") and static_shape(value) == shape:
            return value.args[0]
        return x

    def rewriter(expr: relax.Call, m) -> relax.Expr:
        items, shape = m[stack].args[0], static_shape(expr)
        axes = expr.attrs.axis
        if not isinstance(items, relax.Tuple) or shape is None or bool(expr.attrs.keepdims):
            return expr
        if axes is None or len(axes) != 1 or int(axes[0]) % (len(shape) + 1) != \
                int(m[stack].attrs.axis) % (len(shape) + 1):
            return expr
        operands = [unbroadcast(x, shape) for x in items.fields]
        if not any(static_shape(x) == shape for x in operands):
            operands = list(items.fields)
        out = operands[0]
        for x in operands[1:]:
            out = _ELEMENTWISE[expr.op.name](out, x)
        return out

    return rewrite_call(pattern, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.StackedExtrema")
class StackedExtrema:
    """``max`` / ``min`` over a ``stack`` of same-shape tensors → ``maximum`` / ``minimum``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, lambda f: relax.analysis.remove_all_unused(_rewrite(f)))
