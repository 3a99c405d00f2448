"""Casts of a tensor's slices move above the slices: one cast, which fuses into the producer.

HorizontalGemm makes the Q/K/V projections one GEMM whose fp32 result (fp32 accumulation, the
norm's ``rstd`` applied) is sliced; each slice is then cast to the model's dtype::

    y = multiply(matmul(x, W, out_dtype="float32"), rstd)
    q = astype(strided_slice(y, [1], [0], [E]), "float16");  k = astype(strided_slice(y, ..)); ...

FuseOps fuses elementwise consumers into a GEMM, not slices, so ``y`` is written in fp32 — twice
its fp16 bytes — and read back by every slice's kernel. Rewrite, when every user of ``y`` is a
``strided_slice`` whose every user is ``astype`` to one narrower dtype ``D``, and the slices
together cover ``y`` (no element is cast that nobody reads)::

    y_D = astype(y, D);  q = strided_slice(y_D, [1], [0], [E]);  ...

A cast is elementwise, so it commutes with a slice: the values are bit-identical. ``y_D`` is an
elementwise consumer of the GEMM (its epilogue) and the GEMM writes ``D``. ``y`` must be computed
in this function (not a parameter); anything else is left as it is.

Sits after the passes that match on those slices (HorizontalGemm, PairGemm, the attention layout
and pack passes) and before LegalizeOps.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..relax_shapes import static_shape
from ._util import binding_users, dataflow_bindings, is_op, rewrite_functions

NAME = "cast_before_slices"


def _plan(func: relax.Function) -> dict:
    """``{y: dtype}`` for every tensor whose slices are all cast to one narrower dtype."""
    bound, order = dataflow_bindings(func)
    users = binding_users(func)
    plan = {}
    for y in order:
        ty = y.ty
        if not isinstance(ty, relax.TensorType) or static_shape(y) is None:
            continue
        slices = users.get(y, [])
        if not slices or any(not is_op(bound.get(s), "relax.strided_slice")
                             or not bound[s].args[0].same_as(y) for s in slices):
            continue
        casts = [c for s in slices for c in users.get(s, [None])]
        if any(not is_op(bound.get(c), "relax.astype") for c in casts):
            continue
        dtypes = {str(bound[c].attrs.dtype) for c in casts}
        if len(dtypes) != 1:
            continue
        dtype = dtypes.pop()
        if tvm.DataType(dtype).bits >= tvm.DataType(str(ty.dtype)).bits:
            continue
        covered = sum(math.prod(static_shape(s) or [0]) for s in slices)
        if covered < math.prod(static_shape(y)):
            continue
        plan[y] = dtype
    return plan


@mutator
class _Rewrite(PyExprMutator):
    def __init__(self, plan: dict) -> None:
        super().__init__()
        self.plan = plan
        self.cast: dict = {}  # y → y_D
        self.sliced: dict = {}  # slice var → the slice of y_D

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        var, value = binding.var, binding.value
        if is_op(value, "relax.strided_slice") and value.args[0] in self.cast:
            src = self.cast[value.args[0]]
            new = relax.Call(value.op, [src, *value.args[1:]], value.attrs)
            self.sliced[var] = self.builder_.emit(new, name_hint=str(var.name))
            return
        if is_op(value, "relax.astype") and value.args[0] in self.sliced:
            self.set_var_remap(var, self.sliced[value.args[0]])
            return
        super().visit_var_binding_(binding)
        if var in self.plan:
            self.cast[var] = self.builder_.emit(relax.op.astype(self.visit_expr(var), self.plan[var]),
                                                name_hint=f"{var.name}_cast")


def _rewrite(func: relax.Function) -> relax.Function:
    plan = _plan(func)
    if not plan:
        return func
    return _Rewrite(plan).visit_expr(func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.CastBeforeSlices")
def CastBeforeSlices(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - a pass
    """Every Relax function of ``mod`` rewritten (module doc), on a copy."""
    return rewrite_functions(mod, _rewrite)
