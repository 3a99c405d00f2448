"""Values of Relax expressions that depend on constants only, evaluated once on the CPU.

Exporters compute masks, index grids and scalars from constants in the graph (``arange`` →
``expand_dims`` → comparisons); a pass that must read such a value (the attention matcher's
masks, a gather's constant index grid) asks :class:`ConstantValues` for it. The subgraph from the
constants to the expression is legalised, built for llvm and run once; results are cached per
expression. Anything that reads a function parameter is not constant (None).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .legalize_fixes import legalize_overrides


def function_bindings(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    """var → bound value over every block of ``func``, in binding order."""
    return {b.var: b.value for block in func.body.blocks for b in block.bindings
            if isinstance(b, relax.VarBinding)}


class ConstantValues:
    """Evaluates expressions of one function that depend on constants only."""

    def __init__(self, table: dict[relax.Var, relax.Expr]) -> None:
        self.table = table  # in binding order (function_bindings)
        self.order = {var: i for i, var in enumerate(table)}
        self._cache: dict[relax.Expr, np.ndarray | None] = {}

    def value(self, expr: relax.Expr) -> np.ndarray | None:
        """The value of ``expr`` when it depends on constants only (built and run on llvm)."""
        if isinstance(expr, tvm.ir.expr.Constant):
            return expr.value.numpy()
        if expr in self._cache:
            return self._cache[expr]
        deps: set = set()
        result = None
        if isinstance(expr.ty, relax.TensorType) and self._deps(expr, deps):
            result = _evaluate(expr, sorted(deps, key=self.order.__getitem__), self.table)
        self._cache[expr] = result
        return result

    def _deps(self, expr: relax.Expr, deps: set) -> bool:
        """Collect the bound vars ``expr`` reads into ``deps``; False when it reads a parameter."""
        if isinstance(expr, relax.Var):
            if expr in deps:
                return True
            if expr not in self.table:
                return False  # a function parameter: depends on model inputs
            deps.add(expr)
            return self._deps(self.table[expr], deps)
        if isinstance(expr, relax.Call):
            return all(self._deps(a, deps) for a in expr.args)
        if isinstance(expr, relax.Tuple):
            return all(self._deps(f, deps) for f in expr.fields)
        if isinstance(expr, relax.TupleGetItem):
            return self._deps(expr.tuple_value, deps)
        if isinstance(expr, relax.ShapeExpr):
            return all(isinstance(v, tvm.tirx.IntImm) for v in expr.values)
        if isinstance(expr, tvm.ir.prim.expr.BinaryOpExpr):  # T.Add(1, 8) left by BindSymbolicVars
            return not tvm.tirx.analysis.undefined_vars(expr)
        return isinstance(expr, (tvm.ir.expr.Constant, tvm.ir.expr.StringImm, tvm.tirx.IntImm,
                                 tvm.tirx.FloatImm))


def _evaluate(expr: relax.Expr, deps: list[relax.Var], table: dict) -> np.ndarray:
    """Run the constant subgraph ``deps → expr`` once on the CPU."""
    out = relax.Var("constant_value", expr.ty)
    bindings = [relax.VarBinding(v, table[v]) for v in deps] + [relax.VarBinding(out, expr)]
    func = relax.Function([], relax.SeqExpr([relax.DataflowBlock(bindings)], out), expr.ty)
    mod = tvm.IRModule({"main": func})
    # a pass context of its own: the caller's (instruments, testing.immutable_module) is for the
    # caller's passes, not for building this throwaway module
    with tvm.transform.PassContext(), tvm.target.Target("llvm"):
        mod = relax.transform.LegalizeOps(legalize_overrides())(mod)
        exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return vm["main"]().numpy()
