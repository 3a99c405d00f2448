"""``permute_dims(W)`` of a large 2-D weight constant → the transposed constant, computed in torch.

torch's ``Linear`` stores W as (N, K) and the exporters multiply by ``permute_dims(W)``. The
projections that no pattern pass refolds (attention output, FFN down, an un-normed head) keep that
transpose until TVM's ``FoldConstant``, which builds the transpose kernel for llvm and runs it on
one core: 66 s of a 244 s Llama-2-7B-shaped compile on the H200 machine. Here the same transpose is
done once per weight by :func:`weight_arrays.transpose` (multithreaded), before legalisation; what
``FoldConstant`` sees afterwards is already a constant. Values are unchanged, so the IR after this
pass equals FoldConstant's for these bindings.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from . import weight_arrays
from ._util import is_large_constant, is_op


def _is_weight_transpose(call: relax.Call) -> bool:
    if not is_op(call, "relax.permute_dims"):
        return False
    arg, axes = call.args[0], call.attrs.axes
    return (is_large_constant(arg) and len(arg.value.shape) == 2
            and (axes is None or [int(a) for a in axes] == [1, 0]))


@mutator
class _Fold(PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.made = weight_arrays.DerivedConstants()  # one transpose per weight, for all functions

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not _is_weight_transpose(call):
            return call
        source = call.args[0]  # (the module holds it, so its hash names it)
        return self.made.get(hash(source), lambda: weight_arrays.transpose(weight_arrays.array(source)))


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.FoldWeightTransposes")
class FoldWeightTransposes:
    """``permute_dims(W)`` (2-D weight constant, ≥ 1 MiB) → constant ``Wᵀ`` (one per weight)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Fold(mod.clone())  # the builder adds to its module: not the caller's
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()
