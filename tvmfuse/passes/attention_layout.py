"""Attention on (B, H, S, D) tensors reads and writes them in place: no transpose kernels.

``R.nn.attention`` takes and returns (B, S, H, D); torch's SDPA and the hand-written ``q @ kᵀ``
form work in (B, H, S, D), so the attention rewrite leaves::

    out = permute_dims(attention(permute_dims(q, P), permute_dims(k, P), permute_dims(v, P)), P)
    P = [0, 2, 1, 3],   q (B, Hq, Sq, D),  k, v (B, Hkv, Skv, D),  out (B, Hq, Sq, D)

Left alone, the three operand transposes become a pack kernel (PackAttentionInputs) and the
result transpose a kernel of its own. Here the call is lowered to its attention kernel (the one
``R.nn.attention``'s legalisation would pick, :func:`.attention_lower.attention_kernel`) with
``qkv_layout = "BHSD"`` when q, k and v are all ``permute_dims(x, P)`` of a tensor ``x`` that is
not itself computed by an injective op (a parameter, a GEMM output, a constant: the transpose is
then the only work between ``x`` and the kernel), reading the ``x``; and ``out_layout = "BHSD"``
when the call's only user is ``permute_dims(., P)``, whose value the kernel then writes::

    out = call_tir(attention_kernel(spec(qkv_layout=BHSD, out_layout=BHSD)), (q, k, v), out)

Likewise ``out_layout = "SBHD"`` when the only user is ``permute_dims(., [1, 0, 2, 3])``: torch's
``nn.MultiheadAttention`` with ``batch_first=False`` reads its result sequence first.

Operands computed by injective ops (RoPE in (B, H, S, D)) keep the pack: one kernel writes them
all, where folding only the transposes would leave one kernel per operand; so a call whose
operands PackAttentionInputs would pack is left alone here. A call that folds nothing, or that no
kernel takes, is left to the legalisation. The pass runs twice: after every pass that rewrites
attention operands (mixed precision casts included) and before PackAttentionInputs, which then no
longer sees the folded calls; and after it, when the packed calls' operands are views (nothing
left to pack) and their results' permutations fold.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._util import binding_users, rewrite_with_plans
from .attention_lower import attention_kernel, attention_spec
from .pack_attention_inputs import OperandGraph, pack_plan

_ATTENTION = ("relax.nn.attention", "relax.nn.attention_bias")
_SWAP = [0, 2, 1, 3]  # (B, H, S, D) <-> (B, S, H, D)
# the result's permutations a kernel writes directly: (B, S, H, D) → the layout of its output
_OUT_LAYOUTS = {(0, 2, 1, 3): "BHSD", (1, 0, 2, 3): "SBHD"}


def _permute_of(value, axes: list[int] | tuple[int, ...]) -> relax.Var | None:
    """``x`` when ``value`` is ``permute_dims(x, axes)`` of a 4-D tensor var, else None."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.permute_dims"):
        return None
    got = value.attrs.axes
    if got is None or [int(a) for a in got] != list(axes) or not isinstance(value.args[0], relax.Var):
        return None
    return value.args[0]


def _swap_of(value) -> relax.Var | None:
    """``x`` when ``value`` is ``permute_dims(x, [0, 2, 1, 3])`` of a 4-D tensor var, else None."""
    return _permute_of(value, _SWAP)


def _out_layout(value, var: relax.Var) -> str | None:
    """The layout a kernel writes when ``value`` permutes the attention result ``var`` into it."""
    for axes, layout in _OUT_LAYOUTS.items():
        source = _permute_of(value, axes)
        if source is not None and source.same_as(var):
            return layout
    return None


@dataclasses.dataclass
class _Plan:
    operands: list  # what the kernel reads: q, k, v (the untransposed tensors when folded), bias
    qkv_layout: str
    out_var: relax.Var | None  # the permute the kernel's output replaces (in out_layout)
    out_layout: str = "BSHD"


def _plan(func: relax.Function) -> dict:
    """Attention binding var → :class:`_Plan`, for the calls that fold an operand or output layout."""
    graph = OperandGraph(func)
    users = binding_users(func)
    packed = pack_plan(func)
    plans = {}
    for var, value in graph.bound.items():
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name in _ATTENTION) or attention_spec(value) is None:
            continue
        sources = [_swap_of(graph.bound.get(a)) if isinstance(a, relax.Var) else None
                   for a in value.args[:3]]
        fold_in = all(x is not None and not graph.computed(x) for x in sources)
        readers = users.get(var, [])
        out_var = readers[0] if len(readers) == 1 and readers[0] is not None else None
        out_layout = _out_layout(graph.bound.get(out_var), var) if out_var is not None else None
        out_var = out_var if out_layout is not None else None
        if not fold_in and var in packed:  # the pack kernel writes the operands: keep the op
            continue
        if fold_in or out_var is not None:
            operands = (sources if fold_in else list(value.args[:3])) + list(value.args[3:])
            plans[var] = _Plan(operands, "BHSD" if fold_in else "BSHD", out_var,
                               out_layout or "BSHD")
    return plans


@mutator
class _Fold(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, plans: dict) -> None:
        super().__init__(mod)
        self.plans = plans
        self.written: set = set()  # output transposes whose value the kernel writes

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.written:  # bound to the kernel's call already
            return
        plan = self.plans.get(binding.var)
        if plan is None:
            super().visit_var_binding_(binding)
            return
        call = binding.value
        spec = dataclasses.replace(attention_spec(call), qkv_layout=plan.qkv_layout,
                                   out_layout=plan.out_layout)
        func = attention_kernel(spec)
        if func is None:  # no kernel takes it: the legalisation decomposes the call as before
            super().visit_var_binding_(binding)
            return
        # the report classifies by this name; a kernel's own symbol (TVMScript's default, the sm80
        # one's "flash_attention") would replace it when the module is finalised
        gvar = self.builder_.add_func(func.without_attr("global_symbol"), "attention")
        # the kernel's result keeps the var it replaces (a block output stays one)
        var = binding.var if plan.out_var is None else plan.out_var
        args = [self.visit_expr(a) for a in plan.operands]
        call = self.builder_.normalize(relax.call_tir(gvar, args, var.ty))
        self.builder_.emit_normalized(relax.VarBinding(var, call))
        self.written.add(var)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.FoldAttentionLayout")
class FoldAttentionLayout:
    """(B, H, S, D) attention operands / result read and written in place (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_with_plans(mod, _plan, _Fold)
