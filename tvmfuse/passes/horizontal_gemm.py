"""Linears that read the same input become one GEMM (Q/K/V projections, gate/up pairs).

For one input ``x`` (K features) and n ≥ 2 constant weights ``W_i`` (K, N_i), optional constant
biases ``b_i`` (N_i):

    y_i = x·W_i (+ b_i)          → y = x·[W_1 | … | W_n] (+ [b_1 | … | b_n])
                                    y_i = y[..., o_i : o_i + N_i]      o_i = N_1 + … + N_(i-1)

One launch reads ``x`` once instead of n times and feeds the tensor cores a wide N; the slices
are injective and fuse into their consumers (RoPE, reshapes, the attention call's operands).
Sits after the attention rewrite (which looks through the per-projection reshapes) and before
``NormGemmPrologue`` (which then folds the norm into the single wide GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from . import weight_arrays
from ._util import constant_weight, dataflow_bindings, folded_constant, static_shape
from ._util import is_op as _is_op


@dataclass
class _Member:
    matmul_var: relax.Var
    out_var: relax.Var  # the bias add's var when there is a bias, else matmul_var
    weight: np.ndarray  # (K, N_i)
    bias: np.ndarray | None
    add_var: relax.Var | None


def _groups(func: relax.Function) -> list[list[_Member]]:
    """Groups (≥ 2) of constant-weight matmuls on the same left operand, in binding order."""
    bound, order = dataflow_bindings(func)
    users: dict = {}
    for var in order:
        if isinstance(bound[var], relax.Call):
            for arg in bound[var].args:
                if isinstance(arg, relax.Var):
                    users.setdefault(arg, []).append(var)
    by_input: dict = {}
    for var in order:
        call = bound[var]
        if not _is_op(call, "relax.matmul") or not isinstance(call.args[0], relax.Var):
            continue
        weight = constant_weight(call.args[1], lambda e: bound.get(e, e))
        x_shape = static_shape(call.args[0])
        if weight is None or weight.ndim != 2 or x_shape is None or x_shape[-1] != weight.shape[0]:
            continue
        member = _Member(var, var, weight, None, None)
        uses = users.get(var, [])
        if len(uses) == 1 and _is_op(bound[uses[0]], "relax.add"):
            add = bound[uses[0]]
            other = add.args[1] if add.args[0].same_as(var) else add.args[0]
            # a constant, or one cast to the add's dtype (torch's fp16 Linear adds its bias in fp32)
            bias = folded_constant(other, lambda e: bound.get(e, e))
            if bias is not None and bias.ndim == 1 and bias.shape[0] == weight.shape[1]:
                member.bias, member.add_var, member.out_var = bias, uses[0], uses[0]
        key = (call.args[0], str(call.attrs.out_dtype), str(weight.dtype))
        by_input.setdefault(key, []).append(member)
    groups = []
    for members in by_input.values():
        # Rewritten vars are replaced by dataflow slices: only dataflow vars can be.
        members = [m for m in members if isinstance(m.out_var, relax.DataflowVar)
                   and not _feeds_only_opaque(m.out_var, bound, users)]
        reach = [_elementwise_reach(m.out_var, bound, users) for m in members]
        # Outputs that meet in an elementwise op (SwiGLU's silu(gate)·up) are already one kernel:
        # FuseOps makes the second GEMM's epilogue read the first's output. A wide GEMM would
        # write both halves to HBM and need an extra elementwise kernel to combine them. And an
        # output with an activation of its own (GPT-J / GPT-NeoX's parallel MLP: fc_in beside
        # Q/K/V, then bias + GELU) keeps its GEMM, whose epilogue takes the activation: a wide GEMM
        # has one epilogue, and its slice would go through the activation in a kernel of its own.
        members = [m for i, m in enumerate(members)
                   if not any(bound[u].op.name in _ACTIVATIONS for u in reach[i])
                   and not any(reach[i] & reach[j] for j in range(len(members)) if j != i)]
        if len(members) >= 2:
            groups.append(members)
    return groups


_VIEWS = {"relax.reshape", "relax.permute_dims"}
# Attention operands are not here: PackAttentionInputs writes their slices with the other
# computed operands (RoPE, masks) in one kernel, so a wide GEMM saves launches there too.
_OPAQUE = {"relax.matmul"}


def _feeds_only_opaque(var: relax.Var, bound: dict, users: dict, depth: int = 4) -> bool:
    """True when ``var`` only reaches matmul operands through views.

    Its slice would then be a copy kernel of its own (FuseOps fuses an injective producer into
    elementwise consumers, not into a GEMM), so a separate GEMM costs the same launch and no
    extra HBM pass.
    """
    uses = users.get(var, [])
    if not uses or depth == 0:
        return False
    for user in uses:
        call = bound[user]
        name = call.op.name if isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) else ""
        if name in _OPAQUE:
            continue
        if name in _VIEWS and _feeds_only_opaque(user, bound, users, depth - 1):
            continue
        return False
    return True


_ACTIVATIONS = {"relax.nn.silu", "relax.sigmoid", "relax.nn.gelu", "relax.nn.gelu_tanh",
                "relax.nn.relu", "relax.tanh", "relax.exp", "relax.power", "relax.erf"}
_ELEMENTWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.astype",
                "relax.maximum", "relax.minimum"} | _ACTIVATIONS


def _elementwise_reach(var: relax.Var, bound: dict, users: dict, depth: int = 8) -> set:
    """Vars computed from ``var`` through elementwise ops and views (what FuseOps puts in one
    epilogue; a 3-D MLP reshapes between its GEMMs and their epilogue)."""
    seen, frontier = set(), [var]
    for _ in range(depth):
        frontier = [u for v in frontier for u in users.get(v, [])
                    if isinstance(bound[u], relax.Call) and isinstance(bound[u].op, tvm.ir.Op)
                    and bound[u].op.name in _ELEMENTWISE | _VIEWS and u not in seen]
        seen.update(frontier)
    return seen


@mutator
class _Horizontal(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, groups: list[list[_Member]],
                 weights: weight_arrays.DerivedConstants) -> None:
        super().__init__(mod)
        self.weights = weights  # the concatenated weights, shared by the functions
        self.first = {g[0].matmul_var: g for g in groups}
        self.dropped = {v for g in groups for m in g for v in (m.matmul_var, m.add_var) if v is not None}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        group = self.first.get(binding.var)
        if group is not None:
            call = binding.value
            x = self.visit_expr(call.args[0])
            parts = [m.weight for m in group]
            weight = self.weights.get(weight_arrays.identity(*parts),
                                      lambda: weight_arrays.concatenate(parts, 1), keep=parts)
            y = self.builder_.emit(relax.op.matmul(x, weight, out_dtype=call.attrs.out_dtype))
            if any(m.bias is not None for m in group):
                dtype = next(m.bias.dtype for m in group if m.bias is not None)
                bias = np.concatenate([m.bias if m.bias is not None else np.zeros(m.weight.shape[1], dtype)
                                       for m in group]).astype(dtype)
                y = self.builder_.emit(relax.op.add(y, relax.const(bias)))
            axis, offset = len(static_shape(y)) - 1, 0
            for m in group:
                n = m.weight.shape[1]
                part = self.builder_.emit(relax.op.strided_slice(y, [axis], [offset], [offset + n]))
                self.set_var_remap(m.out_var, part)
                offset += n
            return
        if binding.var in self.dropped:
            return
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.HorizontalGemm")
class HorizontalGemm:
    """x·W_1, …, x·W_n (+ biases) with constant weights → one x·[W_1|…|W_n] and slices."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # the rewriter's builder adds to its module in place: not the caller's
        weights = weight_arrays.DerivedConstants()
        for gvar, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            groups = _groups(func)
            if not groups:
                continue
            rewriter = _Horizontal(mod, groups, weights)
            new = rewriter.visit_expr(func)
            mod = rewriter.builder_.get()
            mod[gvar] = relax.analysis.remove_all_unused(new)
        return mod
