"""A GEMM and the injective kernel that is its output's only reader become one kernel.

After FuseTIR the LM's attention block runs, per layer::

    qkv = call_tir(fused_matmul_multiply_cast, (x, W, rstd))              # QKV GEMM + norm epilogue
    packed = call_tir(fused_strided_slice_..._concatenate, (qkv, cos, sin))  # RoPE, the Q/K/V pack

FuseOps does not fuse the second into the first (a GEMM takes elementwise consumers only), so
the pack is a kernel of its own that reads and writes every QKV element once more. Here the two
calls become one PrimFunc (both put in a ``Primitive`` Relax function, merged by FuseTIR; the
GEMM's output becomes an intermediate buffer) tagged ``GATHER_TAIL_ATTR``::

    packed = call_tir(fused_matmul_multiply_cast_gather_tail, (x, W, rstd, cos, sin))

and the sm_90a GEMM kernel makes the pack's stores in its epilogue (:mod:`..kernels.gemm.tail`:
each output point reads its own accumulator and, for RoPE, the partner column ``j ^ D/2`` that
the same thread holds). A pair is merged only where that analysis takes the merged function, M is
static and above the GEMV's rows, and the target is sm_90a (``Options.sm90_gemm_tail``); after
FuseTIR, before the GEMM passes (which build every GEMM kernel, with or without a tail).
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..attrs import GATHER_TAIL_ATTR
from ..errors import TVM_ERRORS
from ..kernels.gemm.epilogue import NotHandled, analyze, top_blocks
from ..options import current_options
from ..passes._util import rewrite_with_plans
from .gemm_row_stats_simt import fuse_merged

NAME = "fold_gemm_tail"
_CALL_TIR = "relax.call_tir"
MIN_ROWS = 65  # smaller M: the GEMV kernels (rules/gemv.py), which have their own fold


def _prim_call(mod: tvm.IRModule, value) -> tirx.PrimFunc | None:
    """The unscheduled PrimFunc a ``call_tir`` binding calls (None: another binding)."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == _CALL_TIR and isinstance(value.args[0], tvm.ir.GlobalVar)):
        return None
    func = mod[value.args[0]]
    if not isinstance(func, tirx.PrimFunc) or (func.attrs is not None and func.attrs.get(
            "tirx.is_scheduled")):
        return None
    return func


def _plain_gemm(func: tirx.PrimFunc) -> bool:
    try:
        g = analyze(func)
    except NotHandled:
        return False
    return isinstance(g.m, int) and g.m >= MIN_ROWS and g.acc_odd is None and g.tail is None


def _block_count(func: tirx.PrimFunc) -> int:
    return len(top_blocks(func)[1])


def _injective(func: tirx.PrimFunc) -> bool:
    try:
        _, blocks = top_blocks(func)
    except TVM_ERRORS:  # TVM refuses a function that is not block-structured
        return False
    return bool(blocks) and all(iv.iter_type == tirx.IterVar.DataPar
                                for block, _ in blocks for iv in block.iter_vars)


def merged_args(gemm_call: relax.Call, tail_call: relax.Call, pos: int) -> list[relax.Expr]:
    """The merged call's arguments: the GEMM's, then the tail's but ``pos``, each tensor once."""
    args: list[relax.Expr] = []
    for a in [*gemm_call.args[1].fields,
              *(a for i, a in enumerate(tail_call.args[1].fields) if i != pos)]:
        if not any(a.same_as(b) for b in args):
            args.append(a)
    return args


def merge(gemm: tirx.PrimFunc, gemm_call: relax.Call, tail: tirx.PrimFunc, tail_call: relax.Call,
          pos: int) -> tuple[tirx.PrimFunc, list[relax.Expr]]:
    """One PrimFunc computing ``tail_call`` with argument ``pos`` (``gemm_call``'s result) made
    inside, and its call arguments: the GEMM's, then the tail's others (each tensor once)."""
    call_tir = tvm.ir.Op.get(_CALL_TIR)
    args = merged_args(gemm_call, tail_call, pos)
    params = [relax.Var(f"p{i}", a.ty) for i, a in enumerate(args)]

    def param(a):
        return next(p for b, p in zip(args, params) if b.same_as(a))

    bb = relax.BlockBuilder()
    gemm_gv, tail_gv = bb.add_func(gemm, "gemm"), bb.add_func(tail, "tail")
    with bb.function("merged", params, attrs={"Primitive": True}, private=True):
        with bb.dataflow():
            y = bb.emit(relax.Call(call_tir, [gemm_gv, relax.Tuple(
                [param(a) for a in gemm_call.args[1].fields])], gemm_call.attrs, gemm_call.ty_args))
            fields = [y if i == pos else param(a) for i, a in enumerate(tail_call.args[1].fields)]
            z = bb.emit_output(relax.Call(call_tir, [tail_gv, relax.Tuple(fields)], tail_call.attrs,
                                          tail_call.ty_args))
        bb.emit_func_output(z)
    return fuse_merged(bb, args), args


def _plan(mod: tvm.IRModule, func: relax.Function, made: dict) -> dict:
    """Tail binding var → (merged GlobalVar name, call args) for every pair the kernel takes."""
    uses: dict = {}
    bindings = [b for block in func.body.blocks for b in block.bindings]
    for b in bindings:
        for v in relax.analysis.free_vars(b.value):
            uses.setdefault(v, []).append(b)
    for v in relax.analysis.free_vars(func.body.body):
        uses.setdefault(v, []).append(None)
    plans = {}
    for b in bindings:
        gemm = _prim_call(mod, b.value)
        readers = uses.get(b.var, [])
        if gemm is None or len(readers) != 1 or readers[0] is None or not _plain_gemm(gemm):
            continue
        user = readers[0]
        tail = _prim_call(mod, user.value)
        if tail is None or len(user.value.ty_args) != 1 or not _injective(tail):
            continue
        pos = [i for i, a in enumerate(user.value.args[1].fields) if a.same_as(b.var)]
        if len(pos) != 1:
            continue
        key = (b.value.args[0].name_hint, user.value.args[0].name_hint, pos[0])
        if key not in made:
            name = f"{key[0]}_gather_tail" + (str(len(made)) if made else "")
            prim, _ = merge(gemm, b.value, tail, user.value, pos[0])
            prim = prim.with_attr(GATHER_TAIL_ATTR, _block_count(gemm))
            try:
                ok = analyze(prim).tail is not None
            except NotHandled:
                ok = False
            made[key] = (name, prim) if ok else None
        if made[key] is not None:
            plans[user.var] = (made[key], b.value, user.value, pos[0])
    return plans


@mutator
class _Rewrite(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, plans: dict) -> None:
        super().__init__(mod)
        self.plans = plans
        self.added: dict = {}  # name → GlobalVar of the merged PrimFunc

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        found = self.plans.get(binding.var)
        if found is None:
            super().visit_var_binding_(binding)
            return
        (name, prim), gemm_call, tail_call, pos = found
        if name not in self.added:
            self.added[name] = self.builder_.add_func(prim, name)
        args = [self.visit_expr(a) for a in merged_args(gemm_call, tail_call, pos)]
        new = self.builder_.emit(relax.Call(tvm.ir.Op.get(_CALL_TIR), [
            self.added[name], relax.Tuple(args)], tail_call.attrs, tail_call.ty_args))
        self.set_var_remap(binding.var, new)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.FoldGemmTail")
def FoldGemmTail(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - pass names are CamelCase
    """GEMM + its output's only (injective) reader → one PrimFunc (module docstring)."""
    target = tvm.target.Target.current(allow_none=True)
    if not (current_options().sm90_gemm_tail and target is not None
            and target.kind.name == "cuda" and str(target.attrs.get("arch", "")) == "sm_90a"):
        return mod
    made: dict = {}
    return rewrite_with_plans(mod, lambda func: _plan(mod, func, made), _Rewrite)
