"""Small helpers shared by the pattern passes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..relax_shapes import known_shape, shape_expr, static_shape  # noqa: F401  (re-exported)
from . import weight_arrays


def scalar_value(expr: relax.Expr) -> float | None:
    """The value of a one-element constant, else None."""
    if isinstance(expr, tvm.ir.expr.Constant) and isinstance(expr.value, tvm.runtime.Tensor):
        arr = expr.value.numpy()
        if arr.size == 1:
            return float(arr.reshape(-1)[0])
    return None


def is_op(expr: relax.Expr, name: str) -> bool:
    """True when ``expr`` is a call of the Relax operator ``name``."""
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def op_name(expr: relax.Expr) -> str:
    """The Relax operator ``expr`` calls (``"relax.add"``), else ``""``."""
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else ""


def const_array(expr: relax.Expr) -> np.ndarray | None:
    """The value of a constant as a numpy array, else None."""
    if isinstance(expr, tvm.ir.expr.Constant) and isinstance(expr.value, tvm.runtime.Tensor):
        return weight_arrays.array(expr)  # read-only, no copy
    return None


def constant_weight(expr: relax.Expr, lookup: Callable[[relax.Expr], relax.Expr]) -> np.ndarray | None:
    """A constant weight's value, looking through ``permute_dims`` of a constant; ``lookup``
    maps a var to its bound value (identity for anything else)."""
    expr = lookup(expr)
    if is_op(expr, "relax.permute_dims"):
        inner = const_array(lookup(expr.args[0]))
        if inner is None:
            return None
        axes = expr.attrs.axes
        return np.transpose(inner, [int(a) for a in axes] if axes is not None else None)
    return const_array(expr)


_NUMPY_BINARY = {"relax.add": np.add, "relax.subtract": np.subtract,
                 "relax.multiply": np.multiply, "relax.divide": np.divide}


def folded_constant(expr: relax.Expr, lookup: Callable[[relax.Expr], relax.Expr]) -> np.ndarray | None:
    """The value of an expression built only from constants by ``astype`` and elementwise
    add/subtract/multiply/divide (e.g. Gemma's ``1 + w.float()``), computed in its own dtype; a
    constant weight as :func:`constant_weight` reads it; else None."""
    value = constant_weight(expr, lookup)
    if value is not None:
        return value
    expr = lookup(expr)
    if is_op(expr, "relax.astype"):
        inner = folded_constant(expr.args[0], lookup)
        return None if inner is None else inner.astype(str(expr.attrs.dtype))
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in _NUMPY_BINARY:
        a, b = (folded_constant(arg, lookup) for arg in expr.args)
        if a is None or b is None or not isinstance(expr.ty, relax.TensorType):
            return None
        return _NUMPY_BINARY[expr.op.name](a, b).astype(str(expr.ty.dtype))
    return None


def last_axis_only(axis, ndim: int) -> bool:
    """True when a reduction's ``axis`` attribute is exactly the last axis."""
    if axis is None or len(axis) != 1:
        return False
    a = int(axis[0])
    return a == -1 or a == ndim - 1


def split_bounds(call: relax.Call) -> list[int] | None:
    """``[0, e0, e0 + e1, …]``: where each piece of a ``split`` starts and ends along its axis
    (piece i is ``[b[i], b[i + 1])``), from the pieces' static shapes; None when one is symbolic."""
    pieces = call.ty.fields if isinstance(call.ty, relax.TupleType) else []
    axis = int(call.attrs.axis)
    bounds = [0]
    for piece in pieces:
        shape = piece.shape if isinstance(piece, relax.TensorType) else None
        extent = shape.values[axis] if isinstance(shape, relax.ShapeExpr) else None
        if not isinstance(extent, tvm.tirx.IntImm):
            return None
        bounds.append(bounds[-1] + int(extent))
    return bounds if pieces else None


def rewrite_functions(mod: tvm.IRModule, rewrite: Callable[[relax.Function], relax.Function]) -> tvm.IRModule:
    """A copy of ``mod`` with ``rewrite`` applied to every Relax function (not to PrimFuncs)."""
    updates = {gv: rewrite(f) for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    mod = mod.clone()  # assigned into below: not the caller's module
    for gv, f in updates.items():
        mod[gv] = f
    return mod


def mutate_functions(rewriter: PyExprMutator) -> tvm.IRModule:
    """Every Relax function of ``rewriter``'s module through ``rewriter`` (whose builder may add
    PrimFuncs), then dead code removed: the calls it left unused and the PrimFuncs they called."""
    for gv, func in list(rewriter.builder_.get().functions_items()):
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


def rewrite_with_plans(mod: tvm.IRModule, plan: Callable[[relax.Function], dict],
                       rewriter: Callable[[tvm.IRModule, dict], PyExprMutator]) -> tvm.IRModule:
    """A copy of ``mod`` where each Relax function with a non-empty ``plan(func)`` is rewritten
    by ``rewriter(mod, plans)`` (a PyExprMutator whose builder may add PrimFuncs), its unused
    bindings dropped."""
    mod = mod.clone()  # the rewriter's builder adds to its module in place: not the caller's
    for gvar, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function):
            continue
        plans = plan(func)
        if not plans:
            continue
        mutator_ = rewriter(mod, plans)
        new = mutator_.visit_expr(func)
        mod = mutator_.builder_.get()
        mod[gvar] = relax.analysis.remove_all_unused(new)
    return mod


LARGE_CONSTANT_BYTES = 1 << 20  # weight matrices; norm scales, biases and scalars stay constants


def is_large_constant(expr: relax.Expr) -> bool:
    """A tensor constant of ``LARGE_CONSTANT_BYTES`` or more (a weight matrix)."""
    if not (isinstance(expr, tvm.ir.expr.Constant) and isinstance(expr.value, tvm.runtime.Tensor)):
        return False
    data = expr.value
    return int(np.prod(data.shape)) * tvm.runtime.DataType(str(data.dtype)).bits // 8 >= LARGE_CONSTANT_BYTES


_WEIGHT_VIEWS = ("relax.permute_dims", "relax.astype", "relax.reshape", "relax.broadcast_to",
                 "relax.expand_dims", "relax.squeeze")


def weight_constants(func: relax.Function) -> set[int]:
    """``hash`` of every constant that is a GEMM operand or a gather table (``take``'s data),
    directly or through views and casts: the model's weights, never a mask or a position table."""
    bound, _ = dataflow_bindings(func)
    found: set[int] = set()

    def source(expr: relax.Expr) -> None:
        for _ in range(8):
            if isinstance(expr, relax.Var) and expr in bound:
                expr = bound[expr]
            elif isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) \
                    and expr.op.name in _WEIGHT_VIEWS:
                expr = expr.args[0]
            else:
                break
        if isinstance(expr, tvm.ir.expr.Constant):
            found.add(hash(expr))

    for value in bound.values():
        if is_op(value, "relax.matmul"):
            source(value.args[0])
            source(value.args[1])
        elif is_op(value, "relax.take"):
            source(value.args[0])
    return found


@mutator
class _Lift(PyExprMutator):
    """Large constants (only those hashed in ``weights``, if given) → one new Var each, in
    ``lifted`` ({hash: (var, constant)}). Module level, state on the instance: see
    ``tests/test_layers.py::test_tvm_derived_classes_sit_at_module_level``."""

    def __init__(self, weights: set | None) -> None:
        super().__init__()
        self.weights = weights
        self.lifted: dict = {}

    def visit_generic_const_(self, const) -> relax.Expr:
        if not is_large_constant(const) or (self.weights is not None and hash(const) not in self.weights):
            return const
        key = hash(const)
        if key not in self.lifted:
            self.lifted[key] = (relax.Var(f"lifted_weight_{len(self.lifted)}", const.ty), const)
        return self.lifted[key][0]


def lift_large_constants(func: relax.Function, weights_only: bool = False
                         ) -> tuple[relax.Function, dict[relax.Var, relax.Expr]]:
    """``func`` with every constant of ``LARGE_CONSTANT_BYTES`` or more (``weights_only``: only
    :func:`weight_constants`) replaced by a new trailing parameter, and ``{parameter: constant}``
    to bind them back (``Function.bind_params``)."""
    lift = _Lift(weight_constants(func) if weights_only else None)
    body = lift.visit_expr(func.body)
    lifted = lift.lifted
    if not lifted:
        return func, {}
    params = [v for v, _ in lifted.values()]
    return relax.Function(list(func.params) + params, body, func.ret_ty, func.is_pure, func.attrs,
                          func.span), {v: c for v, c in lifted.values()}


def without_large_constants(rewrite: Callable[[relax.Function], relax.Function], weights_only: bool = False
                            ) -> Callable[[relax.Function], relax.Function]:
    """``rewrite`` run with every constant of ``LARGE_CONSTANT_BYTES`` or more replaced by a
    parameter, then bound back. TVM's pattern rewriter (``rewrite_call``) spends time in
    proportion to the constants' bytes each time it changes a function (a 7B-shaped layer: ~1 s
    per GB, per rewrite): a pass that never reads a weight's values need not carry them. The
    rewrite sees the weights as tensors of the same type, so it must not need their values.
    ``weights_only``: lift only :func:`weight_constants` (a pass that reads masks' values)."""

    def run(func: relax.Function) -> relax.Function:
        lifted, binds = lift_large_constants(func, weights_only)
        if not binds:
            return rewrite(func)
        return rewrite(lifted).bind_params(binds)

    return run


def dataflow_bindings(func: relax.Function) -> tuple[dict, list]:
    """``(var → bound value, vars in binding order)`` over the dataflow blocks of ``func``."""
    bound: dict = {}
    order: list = []
    for block in func.body.blocks:
        if isinstance(block, relax.DataflowBlock):
            for binding in block.bindings:
                bound[binding.var] = binding.value
                order.append(binding.var)
    return bound, order


def binding_users(func: relax.Function) -> dict:
    """Var → the binding vars (or None: the function's result) that read it, over all blocks."""
    users: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                users.setdefault(var, []).append(binding.var)
    for var in relax.analysis.free_vars(func.body.body):
        users.setdefault(var, []).append(None)
    return users


def bound_value(mutator, expr: relax.Expr) -> relax.Expr:
    """The value a ``PyExprMutator`` has bound to ``expr`` (a var), else ``expr`` itself."""
    if isinstance(expr, relax.Var):
        value = mutator.lookup_binding(expr)
        return expr if value is None else value
    return expr


def op_pattern(func) -> int | None:
    """A PrimFunc's ``op_pattern`` annotation (AnnotateTIROpPattern); None where there is none."""
    if isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None and "op_pattern" in func.attrs:
        return int(func.attrs["op_pattern"])
    return None


def call_tir_args(value: relax.Expr) -> list | None:
    """The argument list of a ``call_tir`` (None for anything else)."""
    if (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.call_tir" and isinstance(value.args[1], relax.Tuple)):
        return list(value.args[1].fields)
    return None


def with_call_tir_args(call: relax.Call, args: list, callee: tvm.ir.GlobalVar | None = None
                       ) -> relax.Call:
    """``call`` (a call_tir) with its argument tuple replaced, and its callee when given."""
    return relax.Call(call.op, [callee or call.args[0], relax.Tuple(args), *call.args[2:]],
                      call.attrs, call.ty_args, ret_ty=call.ty)


def is_copy(block) -> bool:
    """A spatial ``s_tir.SBlock`` storing one load unchanged (a slice, reshape or transpose)."""
    return (all(iv.iter_type == tirx.IterVar.DataPar for iv in block.iter_vars)
            and isinstance(block.body, tirx.BufferStore)
            and isinstance(block.body.value, tvm.ir.TensorLoad)
            and block.body.value.source.dtype == block.body.buffer.dtype)
