"""Gated Linear pairs become one GEMM with interleaved weight columns (SwiGLU, GeGLU).

For one input ``x`` (…, K) and two constant weights ``W_a``, ``W_b`` (K, N) whose outputs meet
only in elementwise ops (``silu(x·W_a) ⊙ (x·W_b)``):

    y = x·W          W[:, 2j] = W_a[:, j], W[:, 2j+1] = W_b[:, j]          y: (…, 2N)
    out = f(y[..., 0::2], y[..., 1::2])                                     out: (…, N)

with ``f`` the original elementwise ops. The two strided slices are injective, so FuseOps would
keep them out of the GEMM's kernel: the GEMM, the slices and ``f`` are grouped here into one
``Primitive`` Relax function (legalised like any other, then merged by FuseTIR into one PrimFunc:
a matmul block over (…, 2N) followed by ``out[i, j] = f(C[i, 2j], C[i, 2j+1])``). In a GEMM
kernel each thread's accumulator fragment holds adjacent column pairs, so the pair epilogue runs
in registers and ``x`` is read once; on targets without such a kernel it is an ordinary fused
matmul + elementwise function with the graph's numerics.

Sits after ``MixedPrecision`` (the grouped function's dtypes are final) and before LegalizeOps
(which legalises the grouped function's body). Targets: the CPU (llvm) and sm_90a, where the wgmma
kernel takes the pair epilogue (fp16 / bf16, 2-D ``x``, K a multiple of 8, N of 4); other CUDA
targets keep two GEMMs (their GEMM rules cannot schedule a strided-slice epilogue).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._util import is_op, static_shape

# elementwise ops a pair epilogue may use (same shape in, same shape out; constants may broadcast)
_ELEMENTWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.astype",
                "relax.nn.silu", "relax.sigmoid", "relax.nn.gelu", "relax.nn.gelu_tanh",
                "relax.nn.relu", "relax.tanh", "relax.exp", "relax.erf", "relax.power",
                "relax.maximum", "relax.minimum", "relax.clip"}


def _const(expr: relax.Expr, bound: dict) -> np.ndarray | None:
    """Value of a constant seen through permute_dims / astype bindings, else None."""
    expr = bound.get(expr, expr)
    if isinstance(expr, tvm.ir.expr.Constant) and isinstance(expr.value, tvm.runtime.Tensor):
        return expr.value.numpy()
    if is_op(expr, "relax.permute_dims"):
        inner = _const(expr.args[0], bound)
        axes = expr.attrs.axes
        return None if inner is None else np.transpose(
            inner, [int(a) for a in axes] if axes is not None else None)
    if is_op(expr, "relax.astype"):
        inner = _const(expr.args[0], bound)
        return None if inner is None else inner.astype(str(expr.attrs.dtype))
    return None


@dataclass
class _Pair:
    root: relax.Var  # the binding that combines the two GEMMs' outputs
    x: relax.Expr
    a: relax.Var  # the two matmul vars
    b: relax.Var
    weight: np.ndarray  # interleaved (K, 2N)
    out_dtype: str | None
    body: list[relax.Var]  # epilogue bindings between the matmuls and root, in order (root last)


def _target_takes(x: relax.Expr, weight: np.ndarray) -> bool:
    """Whether the current target has a kernel for the grouped function (see the docstring)."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name == "llvm":
        return True
    if target.kind.name != "cuda" or str(target.attrs.get("arch", "")) != "sm_90a":
        return False
    shape = static_shape(x)
    k, n = weight.shape[0], weight.shape[1] // 2
    return (str(x.ty.dtype) in ("float16", "bfloat16") and shape is not None and len(shape) == 2
            and k % 8 == 0 and n % 4 == 0)


def _find(func: relax.Function) -> list[_Pair]:
    """Pairs of constant-weight matmuls on one input whose outputs meet only elementwise."""
    bound: dict = {}
    users: dict = {}
    order: list = []
    for block in func.body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            continue
        for binding in block.bindings:
            bound[binding.var] = binding.value
            order.append(binding.var)
            for used in relax.analysis.free_vars(binding.value):
                users.setdefault(used, []).append(binding.var)
    for used in relax.analysis.free_vars(func.body.body):  # the function's result
        users.setdefault(used, []).append(func)

    def matmul_weight(var) -> np.ndarray | None:
        call = bound.get(var)
        if not is_op(call, "relax.matmul") or not isinstance(call.args[0], relax.Var):
            return None
        w = _const(call.args[1], bound)
        return w if w is not None and w.ndim == 2 else None

    def sources(var, seen: set) -> set | None:
        """The matmul vars ``var`` is computed from through elementwise ops (None: other ops)."""
        if matmul_weight(var) is not None:
            return {var}
        call = bound.get(var)
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
                and call.op.name in _ELEMENTWISE):
            return None
        seen.add(var)
        out: set = set()
        for arg in call.args:
            if isinstance(arg, tvm.ir.expr.Constant):
                continue
            if not isinstance(arg, relax.Var):
                return None
            found = sources(arg, seen)
            if found is None:
                return None
            out |= found
        return out

    pairs, taken = [], set()
    for var in order:
        call = bound[var]
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
                and call.op.name in _ELEMENTWISE):
            continue
        inner: set = set()
        src = sources(var, inner)
        if src is None or len(src) != 2 or src & taken:
            continue
        a, b = sorted(src, key=order.index)
        ca, cb = bound[a], bound[b]
        wa, wb = matmul_weight(a), matmul_weight(b)
        shape = static_shape(a)
        if not (ca.args[0].same_as(cb.args[0]) and wa.shape == wb.shape and wa.dtype == wb.dtype
                and str(ca.attrs.out_dtype) == str(cb.attrs.out_dtype)
                and shape is not None and shape == static_shape(b)):
            continue
        # every intermediate has the matmuls' shape and is used inside the group only
        inner.discard(var)
        group = inner | {a, b}
        if any(static_shape(v) != shape for v in inner | {var}) or any(
                u not in group and not u.same_as(var) for v in group for u in users.get(v, [])):
            continue
        # each operand of the root must depend on one matmul alone: a gate and an up projection
        if any(len(sources(arg, set()) or ()) != 1 for arg in call.args
               if isinstance(arg, relax.Var)):
            continue
        weight = np.stack([wa, wb], axis=2).reshape(wa.shape[0], 2 * wa.shape[1])
        if not _target_takes(ca.args[0], weight):
            continue
        # a trailing elementwise chain on the result alone (a cast back to the model dtype) joins
        while len(users.get(var, [])) == 1 and isinstance(users[var][0], relax.Var):
            nxt = users[var][0]
            ncall = bound[nxt]
            if not (isinstance(ncall, relax.Call) and isinstance(ncall.op, tvm.ir.Op)
                    and ncall.op.name in _ELEMENTWISE
                    and static_shape(nxt) == shape and all(
                        a.same_as(var) or isinstance(a, tvm.ir.expr.Constant) for a in ncall.args)):
                break
            inner.add(var)
            var = nxt
        inner.add(var)
        body = [v for v in order if v in inner]
        out_dtype = ca.attrs.out_dtype
        pairs.append(_Pair(var, ca.args[0], a, b, weight,
                           None if out_dtype is None else str(out_dtype), body))
        taken |= group
    return pairs


@mutator
class _Rewrite(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, pairs: list[_Pair], bound: dict) -> None:
        super().__init__(mod)
        self.pairs = {p.root: p for p in pairs}
        self.bound = bound

    def _group_func(self, p: _Pair) -> tuple[relax.Function, list[relax.Expr]]:
        """``fn(x, W, consts…) = f(slice_even(x·W), slice_odd(x·W))`` marked Primitive."""
        x = relax.Var("x", p.x.ty)
        w_const = relax.const(p.weight)
        w = relax.Var("w", w_const.ty)
        params, args, const_params = [x, w], [p.x, w_const], {}
        bb = relax.BlockBuilder()
        with bb.function("pair_gemm", attrs={"Primitive": True}, private=True):
            with bb.dataflow():
                y = bb.emit(relax.op.matmul(x, w, out_dtype=p.out_dtype))
                axis = len(static_shape(y)) - 1
                n2 = int(p.weight.shape[1])
                vmap = {p.a: bb.emit(relax.op.strided_slice(y, [axis], [0], [n2], [2])),
                        p.b: bb.emit(relax.op.strided_slice(y, [axis], [1], [n2], [2]))}
                out = None
                for var in p.body:
                    call = self.bound[var]
                    new_args = []
                    for arg in call.args:
                        if isinstance(arg, tvm.ir.expr.Constant):  # constants become parameters
                            if arg not in const_params:
                                const_params[arg] = relax.Var(f"c{len(const_params)}", arg.ty)
                            arg = const_params[arg]
                        new_args.append(vmap.get(arg, arg))
                    new = relax.Call(call.op, new_args, call.attrs, call.ty_args)
                    out = vmap[var] = (bb.emit_output if var.same_as(p.root) else bb.emit)(new)
            bb.emit_func_output(out, params + list(const_params.values()))
        func = bb.get()["pair_gemm"]
        return func, args + list(const_params)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        p = self.pairs.get(binding.var)
        if p is None:
            super().visit_var_binding_(binding)
            return
        func, args = self._group_func(p)
        gv = self.builder_.add_func(func, "fused_matmul_pair")
        # same var (dataflow or output), new value: the call of the grouped function
        super().visit_var_binding_(relax.VarBinding(binding.var, relax.Call(gv, args)))


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.PairGemm")
class PairGemm:
    """silu(x·W_a) ⊙ (x·W_b) (constant weights) → one x·W (interleaved) with a pair epilogue."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gvar, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or func.attrs and func.attrs.get("Primitive"):
                continue
            pairs = _find(func)
            if not pairs:
                continue
            bound = {b.var: b.value for blk in func.body.blocks for b in blk.bindings}
            rewriter = _Rewrite(mod, pairs, bound)
            new = rewriter.visit_expr(func)
            mod = rewriter.builder_.get()
            mod[gvar] = relax.analysis.remove_all_unused(new)
        return mod
