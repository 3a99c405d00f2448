"""Slices that the symbols' ranges prove in bounds keep exact symbolic shapes.

    strided_slice(t, [a], [0], [S], assume_inbound=False) : (min(S, 64), d)
      → strided_slice(t, [a], [0], [S], assume_inbound=True) : (S, d)      when 1 <= S <= 64

torch's ``self.cos[:s]`` (RoPE tables of ``max_seq`` rows, ``s`` the symbolic length) imports as a
clamped slice whose length ``min(S, 64)`` no broadcast can match with ``S``: the ops after it lose
their shapes (``ndim=4`` only) and cannot be legalised. Under the function's
``tir_var_lower_bound`` / ``tir_var_upper_bound`` the clamp is the identity; the slice is rewritten
only when every output dim is then provably equal. Static graphs are unchanged. Any position in the
canonical list; first, so the passes after it see exact shapes.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.sym import Analyzer

from .._util import is_op
from ._common import rewrite_relax_functions


def bounded_analyzer(func: relax.Function) -> Analyzer | None:
    """An analyzer that knows ``func``'s symbol ranges; None when it has none."""
    attrs = func.attrs or {}
    lower = {str(k): int(v) for k, v in dict(attrs.get("tir_var_lower_bound", {})).items()}
    upper = {str(k): int(v) for k, v in dict(attrs.get("tir_var_upper_bound", {})).items()}
    if not upper:
        return None
    analyzer = Analyzer()
    for var in relax.analysis.defined_symbolic_vars(func):
        if var.name in upper:
            lo = lower.get(var.name, 0)
            analyzer.bind(var, tvm.ir.Range.from_min_extent(lo, upper[var.name] - lo + 1))
    return analyzer


@mutator
class _InBound(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, analyzer: Analyzer) -> None:
        super().__init__(mod)
        self.analyzer = analyzer

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.strided_slice") or call.attrs.assume_inbound:
            return call
        data, axes, *rest = call.args
        ndim = data.ty.ndim if isinstance(data.ty, relax.TensorType) else -1
        if ndim < 0 or not isinstance(axes, relax.Tuple):
            return call
        # TVM's in-bounds legalisation takes axes as given: -1 must be written ndim - 1
        axes = [int(a.value) % ndim for a in axes.fields]
        new = self.builder_.normalize(relax.op.strided_slice(data, axes, *rest, assume_inbound=True))
        old_shape = self.builder_.normalize(call).ty.shape
        if old_shape is None or new.ty.shape is None:
            return call
        same = all(self.analyzer.can_prove_equal(a, b)
                   for a, b in zip(old_shape.values, new.ty.shape.values))
        return new if same else call


def _rewrite(mod: tvm.IRModule, func: relax.Function) -> relax.Function:
    analyzer = bounded_analyzer(func)
    return func if analyzer is None else _InBound(mod, analyzer).visit_expr(func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.BoundedSlices")
class BoundedSlices:
    """Clamped ``strided_slice``s that the symbol bounds prove in range → ``assume_inbound``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_relax_functions(mod, _rewrite)
