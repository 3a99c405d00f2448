"""Attention operands computed by injective ops are written by one kernel into one buffer.

An attention call's operands are often not GEMM outputs but copies and rewrites of them: RoPE on
Q and on K (slice, rotate_half, cos/sin products, transposes), the V slice of a wide QKV GEMM,
BERT's padding-mask bias (cast, reshape, gather, where). Each is injective, yet they are siblings
with no common consumer but the attention call, which FuseOps never fuses into, so each becomes
a kernel of its own. Written instead as::

    packed = concat([reshape(q, [-1]), reshape(k, [-1]), reshape(v, [-1]), reshape(bias, [-1])])
    q' = view(packed, q.shape, offset 0)
    k' = ensure_zero_offset(view(packed, k.shape, offset |q|))            (|x|: bytes of x)
    ...
    attention(q', k', v', bias')

the concat is one injective sink that FuseOps fuses every chain into: one kernel writes all
operands, each lands in its own contiguous, aligned range of ``packed``, and the attention
kernel reads them in place (``R.memory.view`` is a view; ``ensure_zero_offset`` moves the
offset into the data pointer, a copy-free step for offsets that are multiples of 64 bytes, the
only ones this pass makes). Memory planning keeps ``packed`` alive while a view is.

An operand is packed when it is computed (the output of an injective op that is not a GEMM
epilogue: not a GEMM output, parameter or constant, looking through reshapes and elementwise ops
on a GEMM), only attention calls read it, its shape is static, and at least two operands of one
call qualify, of one dtype (one alone is a kernel either way). An operand shared by several
calls (a padding mask) is packed with the first and read as a view by the others. Sits after
every pass that rewrites attention operands (horizontal GEMM slices, reshape sinking, mixed
precision casts) and before LegalizeOps.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._util import op_name, rewrite_with_plans, shape_expr, static_shape

_ATTENTION = ("relax.nn.attention", "relax.nn.attention_bias")
_ELEMENTWISE = {
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.negative", "relax.astype",
    "relax.where", "relax.less", "relax.greater", "relax.less_equal", "relax.greater_equal",
    "relax.equal", "relax.not_equal", "relax.logical_not", "relax.logical_and", "relax.logical_or",
    "relax.cos", "relax.sin", "relax.exp", "relax.sqrt", "relax.rsqrt", "relax.tanh", "relax.sigmoid",
    "relax.nn.silu", "relax.maximum", "relax.minimum", "relax.clip",
}
# Injective ops whose output elements each come from one input element (FuseOps fuses them all).
_INJECTIVE = _ELEMENTWISE | {
    "relax.reshape", "relax.permute_dims", "relax.strided_slice", "relax.concat", "relax.take",
    "relax.expand_dims", "relax.squeeze", "relax.broadcast_to",
}
_ALIGN = 64  # bytes: the runtime's allocation alignment; ensure_zero_offset copies otherwise


class OperandGraph:
    """Bindings, users and constant-derived vars of one function's dataflow blocks."""

    def __init__(self, func: relax.Function) -> None:
        self.bound: dict = {}
        self.users: dict = {}
        self.const: set = set()
        for block in func.body.blocks:
            for binding in block.bindings:
                value = binding.value
                self.bound[binding.var] = value
                args = list(value.args) if isinstance(value, relax.Call) else []
                for arg in args:
                    for leaf in arg.fields if isinstance(arg, relax.Tuple) else [arg]:
                        if isinstance(leaf, relax.Var):
                            self.users.setdefault(leaf, []).append(binding.var)
                if isinstance(value, relax.Call) and op_name(value) and all(
                        self._constant(a) for a in args):
                    self.const.add(binding.var)  # FoldConstant makes it a constant

    def _constant(self, expr: relax.Expr) -> bool:
        if isinstance(expr, relax.Tuple):
            return all(self._constant(f) for f in expr.fields)
        if isinstance(expr, relax.Var):
            return expr in self.const
        return not isinstance(expr, relax.Call)  # constants, shapes, prim values

    def producer_vars(self, var: relax.Var) -> list[relax.Var]:
        """Non-constant vars the binding of ``var`` reads."""
        value = self.bound.get(var)
        if not isinstance(value, relax.Call):
            return []
        leaves = [leaf for arg in value.args
                  for leaf in (arg.fields if isinstance(arg, relax.Tuple) else [arg])]
        return [v for v in leaves if isinstance(v, relax.Var) and v not in self.const]

    def from_gemm(self, var: relax.Var, depth: int = 8) -> bool:
        """``var`` is a GEMM output, possibly through reshapes and a one-user elementwise epilogue."""
        name = op_name(self.bound.get(var))
        if name == "relax.matmul":
            return True
        if depth == 0 or not (name in _ELEMENTWISE or name == "relax.reshape"):
            return False
        return any(self.from_gemm(v, depth - 1) for v in self.producer_vars(var)
                   if len(self.users.get(v, [])) == 1 or name == "relax.reshape")

    def computed(self, var: relax.Var) -> bool:
        """``var`` comes out of an injective op that is not a GEMM epilogue: it is a kernel's
        output that FuseOps would fuse into a concat consuming it."""
        return op_name(self.bound.get(var)) in _INJECTIVE and not self.from_gemm(var)


def pack_plan(func: relax.Function) -> dict:
    """Attention binding var → operand vars (in argument order) to pack for that call."""
    graph = OperandGraph(func)
    plans, packed = {}, set()
    for var, value in graph.bound.items():
        if op_name(value) not in _ATTENTION:
            continue
        chosen = []
        for arg in value.args:
            if not isinstance(arg, relax.Var) or arg in packed or arg in chosen:
                continue
            if static_shape(arg) is None or not graph.computed(arg):
                continue
            if not all(op_name(graph.bound.get(u)) in _ATTENTION for u in graph.users.get(arg, [])):
                continue
            chosen.append(arg)
        by_dtype: dict = {}
        for arg in chosen:
            by_dtype.setdefault(str(arg.ty.dtype), []).append(arg)
        group = max(by_dtype.values(), key=len, default=[])
        if len(group) < 2:
            continue
        offsets = _offsets(group)
        if any(off % _ALIGN for off in offsets):
            continue
        plans[var] = group
        packed.update(group)
    return plans


def _offsets(group: list[relax.Var]) -> list[int]:
    """Byte offset of each operand in the packed buffer."""
    out, off = [], 0
    for var in group:
        out.append(off)
        off += int(np.prod(static_shape(var))) * tvm.DataType(str(var.ty.dtype)).bits // 8
    return out


@mutator
class _Pack(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, plans: dict) -> None:
        super().__init__(mod)
        self.plans = plans

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        group = self.plans.get(binding.var)
        if group is not None:
            flats = []
            for var in group:
                size = int(np.prod(static_shape(var)))
                flats.append(self.builder_.emit(relax.op.reshape(self.visit_expr(var), shape_expr([size]))))
            packed = self.builder_.emit(relax.op.concat(flats, axis=0))
            for var, offset in zip(group, _offsets(group)):
                view = self.builder_.emit(relax.op.memory.view(
                    packed, shape_expr(static_shape(var)), str(var.ty.dtype),
                    relax.prim_value(tvm.tirx.IntImm("int64", offset))))
                if offset:
                    view = self.builder_.emit(relax.op.memory.ensure_zero_offset(view))
                self.set_var_remap(var, view)
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.PackAttentionInputs")
class PackAttentionInputs:
    """Computed attention operands → one concat kernel + views (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_with_plans(mod, pack_plan, _Pack)
