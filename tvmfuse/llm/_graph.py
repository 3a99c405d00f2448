"""Helpers of the LM passes: binding tables, constant-only closures and their evaluation."""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.sym import Analyzer

from ..errors import CompileError
from ..passes.legalize_fixes import legalize_overrides

# a CompileError raised inside one of these passes crosses TVM's pass machinery as itself (else
# tvm_ffi turns it into a RuntimeError with the same text)
tvm_ffi.register_error("CompileError", CompileError)


def bindings(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    """var → bound value, in program order."""
    return {b.var: b.value for block in func.body.blocks for b in block.bindings
            if isinstance(b, relax.VarBinding)}


def var_name(var: relax.Var) -> str:
    return str(var.name)


def users(table: dict[relax.Var, relax.Expr], result: relax.Expr) -> dict[relax.Var, list]:
    """var → the bindings (their vars; None for the function result) that read it."""
    out: dict[relax.Var, list] = {}
    for var, value in table.items():
        for used in relax.analysis.free_vars(value):
            out.setdefault(used, []).append(var)
    for used in relax.analysis.free_vars(result):
        out.setdefault(used, []).append(None)
    return out


def param_free(table: dict[relax.Var, relax.Expr]) -> set[relax.Var]:
    """Bound vars computed from constants and symbolic shapes only (no function parameter)."""
    free: set[relax.Var] = set()
    for var, value in table.items():
        # free_vars also lists symbolic dims (tirx vars): those are shapes, not data
        if all(v in free or (v not in table and not isinstance(v.ty, relax.TensorType))
               for v in relax.analysis.free_vars(value)):
            free.add(var)
    return free


def closure(table: dict[relax.Var, relax.Expr], roots: list[relax.Var]) -> list[relax.Var]:
    """The bindings ``roots`` depend on, in program order."""
    need: set[relax.Var] = set()
    stack = list(roots)
    while stack:
        var = stack.pop()
        if var in need or var not in table:
            continue
        need.add(var)
        stack.extend(relax.analysis.free_vars(table[var]))
    return [v for v in table if v in need]


@relax.expr_functor.mutator
class _PrimSimplifier(relax.PyExprMutator):
    """Folds constant PrimExprs in tuple fields (``T.Add(1, 8)`` → 9) that shape binding leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.analyzer = Analyzer()

    def visit_tuple_(self, op: relax.Tuple) -> relax.Expr:
        fields = [self.analyzer.simplify(f) if isinstance(f, tvm.ir.prim.expr.BinaryOpExpr)
                  else self.visit_expr(f) for f in op.fields]
        return relax.Tuple(fields)


def bind_shapes(func: relax.Function, values: dict[str, int]) -> relax.Function:
    """``func`` with its symbolic dims named in ``values`` made static (and folded)."""
    names = {str(v): v for v in [*relax.analysis.defined_symbolic_vars(func),
                                 *relax.analysis.free_symbolic_vars(func)]}
    func = func.bind_symbolic_vars({names[k]: v for k, v in values.items() if k in names})
    func = _PrimSimplifier().visit_expr(func)
    return relax.transform.CanonicalizeBindings()(tvm.IRModule({"main": func}))["main"]


def _symbolic_dims(expr: relax.Expr) -> list[tvm.tirx.Var]:
    func = relax.Function([], expr, expr.body.ty if isinstance(expr, relax.SeqExpr) else None)
    return list(relax.analysis.free_symbolic_vars(func))


def evaluate(table: dict[relax.Var, relax.Expr], outs: list[relax.Var],
             shapes: dict[str, int]) -> list[np.ndarray]:
    """Run the parameter-free bindings that ``outs`` depend on, symbolic dims set to ``shapes``."""
    order = closure(table, outs)
    body = relax.SeqExpr([relax.DataflowBlock([relax.VarBinding(v, table[v]) for v in order])],
                         relax.Tuple(outs))
    ret = relax.TupleType([v.ty for v in outs])
    # a shape parameter defines the symbolic dims (binding needs them defined), then goes away
    dims = relax.Var("dims", relax.ShapeType(_symbolic_dims(body)))
    func = bind_shapes(relax.Function([dims], body, ret), shapes)
    func = relax.Function([], func.body, func.ret_ty)
    mod = tvm.IRModule({"main": func})
    with tvm.target.Target("llvm"):
        mod = relax.transform.LegalizeOps(legalize_overrides())(mod)
        exe = tvm.compile(mod, target="llvm")
    result = relax.VirtualMachine(exe, tvm.cpu())["main"]()
    return [r.numpy() for r in result]
