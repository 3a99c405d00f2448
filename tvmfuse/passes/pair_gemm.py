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
(which legalises the grouped function's body). Targets: the CPU (llvm), sm_90a, where the wgmma
kernel takes the pair epilogue (fp16 / bf16, 2-D ``x``, K a multiple of 8, N of 4), and other
sm_80+ targets at decode size with ``Options.small_m_gemv`` (x with ≤ 64 rows: the
weight-streaming kernel takes it); otherwise
CUDA targets keep two GEMMs (their GEMM rules cannot schedule a strided-slice epilogue).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..options import current_options
from ..relax_shapes import known_shape, same_dim, same_shape
from . import weight_arrays
from ._util import dataflow_bindings, is_op, split_bounds

# elementwise ops a pair epilogue may use (same shape in, same shape out; constants may broadcast)
_ELEMENTWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.astype",
                "relax.nn.silu", "relax.sigmoid", "relax.nn.gelu", "relax.nn.gelu_tanh",
                "relax.nn.relu", "relax.tanh", "relax.exp", "relax.erf", "relax.power",
                "relax.maximum", "relax.minimum", "relax.clip"}


def _const(expr: relax.Expr, bound: dict) -> np.ndarray | None:
    """Value of a constant seen through permute_dims / astype bindings, else None."""
    expr = bound.get(expr, expr)
    if isinstance(expr, tvm.ir.expr.Constant) and isinstance(expr.value, tvm.runtime.Tensor):
        return weight_arrays.array(expr)
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
    root: relax.Var  # the binding that combines the gate and up values
    x: relax.Expr
    matmul: relax.Call  # (one of) the original matmul call(s): its out_dtype is kept
    halves: tuple[np.ndarray, np.ndarray]  # W_a, W_b (K, N): interleaved when the pair is rewritten
    a: relax.Var  # leaves: the gate value (even GEMM columns) and the up value (odd columns)
    b: relax.Var
    body: list[relax.Var]  # elementwise bindings from the leaves to root, in order (root last)
    wide: relax.Var | None = None  # one-GEMM form: the (…, 2N) matmul var
    pre: list[relax.Var] = field(default_factory=list)  # ... and its row-wise chain before slicing


_STREAMING_MAX_M = 64  # rows up to which sm_80+ GEMMs stream their weight (rules/gemv.py MAX_M)


def _target_takes(x: relax.Expr, k: int, n: int) -> bool:
    """Whether the current target has a kernel for the grouped function (see the docstring); the
    interleaved weight is (k, 2n)."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name == "llvm":
        return True
    arch = str(target.attrs.get("arch", "")) if target.kind.name == "cuda" else ""
    shape = known_shape(x)  # rows may be symbolic (--dynamic)
    if not (str(x.ty.dtype) in ("float16", "bfloat16") and shape is not None and len(shape) == 2
            and k % 8 == 0):
        return False
    if arch == "sm_90a":
        return n % 4 == 0
    # other sm_80+: the decode-size weight-streaming kernel (rules/gemv.py) takes the pair epilogue
    return (current_options().small_m_gemv and arch[3:5].isdigit() and int(arch[3:5]) >= 80
            and isinstance(shape[0], int)
            and shape[0] <= min(_STREAMING_MAX_M, current_options().gemv_max_m))


def _ints(tup: relax.Expr) -> list[int] | None:
    """A strided_slice axes / begin / end / strides tuple as ints."""
    try:
        return [int(f) for f in tup.fields]
    except (AttributeError, TypeError):
        return None


def _is_elementwise(call) -> bool:
    return (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
            and call.op.name in _ELEMENTWISE)


def _find(func: relax.Function) -> list[_Pair]:
    """Gate/up pairs whose values meet only in elementwise ops: two constant-weight matmuls on one
    input, or the two column halves of one such matmul (HorizontalGemm's merged form)."""
    bound, order = dataflow_bindings(func)
    users: dict = {}
    for var in order:
        for used in relax.analysis.free_vars(bound[var]):
            users.setdefault(used, []).append(var)
    for used in relax.analysis.free_vars(func.body.body):  # the function's result
        users.setdefault(used, []).append(func)

    def matmul_weight(var) -> np.ndarray | None:
        call = bound.get(var)
        if not is_op(call, "relax.matmul") or not isinstance(call.args[0], relax.Var):
            return None
        w = _const(call.args[1], bound)
        return w if w is not None and w.ndim == 2 else None

    def wide_source(z) -> tuple[relax.Var, list[relax.Var]] | None:
        """(matmul var, chain) when ``z`` is a constant-weight matmul after a row-wise chain of
        elementwise ops (their other operands constant or one value per row, e.g. a norm's rstd)."""
        chain, shape = [], known_shape(z)
        while matmul_weight(z) is None:
            call = bound.get(z)
            if not _is_elementwise(call):
                return None
            same = [a for a in call.args if isinstance(a, relax.Var) and same_shape(known_shape(a), shape)]
            if len(same) != 1 or any(
                    isinstance(a, relax.Var) and not a.same_as(same[0])
                    and not same_dim((known_shape(a) or [0])[-1], 1) for a in call.args):
                return None
            chain.insert(0, z)
            z = same[0]
        return z, chain

    def half_of(var) -> tuple[relax.Var, int, list[relax.Var]] | None:
        """(sliced var, 0 | 1, the split's tuple var if any) when ``var`` is the first or second
        half of a matmul's columns: a strided_slice (its end may run past the axis: ``y[..., n:]``)
        or a piece of a ``split`` in two (``y.chunk(2, -1)``) along the last axis."""
        call = bound.get(var)
        if isinstance(call, relax.TupleGetItem) and is_op(bound.get(call.tuple_value), "relax.split"):
            split = bound[call.tuple_value]
            z, shape, tuple_var = split.args[0], known_shape(split.args[0]), [call.tuple_value]
            bounds = split_bounds(split)
            if shape is None or not isinstance(shape[-1], int) or bounds is None or len(bounds) != 3:
                return None
            begin, end = [bounds[call.index]], [bounds[call.index + 1]]
            axes, strides = [int(split.attrs.axis) % len(shape)], [1]
        elif is_op(call, "relax.strided_slice"):
            z, shape, tuple_var = call.args[0], known_shape(call.args[0]), []
            axes, begin, end = (_ints(a) for a in call.args[1:4])
            strides = _ints(call.args[4]) if len(call.args) > 4 else [1]
            if shape is None or not isinstance(shape[-1], int) or axes is None:
                return None
            axes = [a % len(shape) for a in axes]
            end = [min(e, shape[-1]) for e in end] if end else end
        else:
            return None
        if not isinstance(z, relax.Var) or shape[-1] % 2 or axes != [len(shape) - 1] \
                or strides != [1]:
            return None
        half = shape[-1] // 2
        if [begin, end] not in ([[0], [half]], [[half], [2 * half]]) or wide_source(z) is None:
            return None
        return z, int(begin[0] == half), tuple_var

    def per_row(var) -> bool:
        """A tensor computed outside the pair with one value per row, e.g. ``rstd`` (M, 1)."""
        shape = known_shape(var) if isinstance(var, relax.Var) else None
        return bool(shape) and same_dim(shape[-1], 1) and not _is_elementwise(bound.get(var)) \
            and matmul_weight(var) is None

    def same_input(x1, x2) -> bool:
        """One GEMM input: the same var, or two bindings of one expression (``astype(x)`` twice)."""
        return x1.same_as(x2) or (x1 in bound and x2 in bound
                                  and tvm_ffi.structural_equal(bound[x1], bound[x2]))

    def sources(var, seen: set) -> set | None:
        """The leaves (matmuls, halves) ``var`` is computed from through elementwise ops."""
        if matmul_weight(var) is not None or half_of(var) is not None:
            return {var}
        call = bound.get(var)
        if not _is_elementwise(call):
            return None
        seen.add(var)
        out: set = set()
        for arg in call.args:
            if isinstance(arg, tvm.ir.expr.Constant | tirx.IntImm | tirx.FloatImm) or per_row(arg):
                continue  # constants, clip's bounds, one value per row (a norm's rstd)
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
        if not _is_elementwise(call):
            continue
        inner: set = set()
        src = sources(var, inner)
        if src is None or len(src) != 2 or src & taken:
            continue
        inner.discard(var)
        a, b = sorted(src, key=order.index)
        shape = known_shape(a)
        if shape is None or not same_shape(shape, known_shape(b)):
            continue
        halves = half_of(a), half_of(b)
        if halves[0] is None and halves[1] is None:  # two GEMMs
            ca, cb = bound[a], bound[b]
            wa, wb = matmul_weight(a), matmul_weight(b)
            if not (same_input(ca.args[0], cb.args[0]) and wa.shape == wb.shape
                    and wa.dtype == wb.dtype
                    and str(ca.attrs.out_dtype) == str(cb.attrs.out_dtype)):
                continue
            wide, pre, mm, outer = None, [], ca, {a, b}
        elif None not in halves and halves[0][0].same_as(halves[1][0]) \
                and {halves[0][1], halves[1][1]} == {0, 1}:  # one GEMM, two column halves
            if halves[0][1] == 1:
                a, b = b, a
            wide, pre = wide_source(halves[0][0])
            mm = bound[wide]
            w = matmul_weight(wide)
            wa, wb = w[:, : w.shape[1] // 2], w[:, w.shape[1] // 2:]
            outer = {a, b, wide, *pre, *halves[0][2], *halves[1][2]}
        else:
            continue
        if not _target_takes(mm.args[0], wa.shape[0], wa.shape[1]):
            continue
        # every intermediate has the leaves' shape and is used inside the group only
        group = inner | outer
        if any(not same_shape(known_shape(v), shape) for v in inner | {var}) or any(
                u not in group and not u.same_as(var) for v in group for u in users.get(v, [])):
            continue
        # each operand of the root must depend on one leaf alone: a gate and an up projection
        if any(len(sources(arg, set()) or ()) != 1 for arg in call.args
               if isinstance(arg, relax.Var)):
            continue
        # a trailing elementwise chain on the result alone (a cast back to the model dtype) joins
        while len(users.get(var, [])) == 1 and isinstance(users[var][0], relax.Var):
            nxt = users[var][0]
            ncall = bound[nxt]
            if not (_is_elementwise(ncall) and same_shape(known_shape(nxt), shape) and all(
                    a_.same_as(var) or isinstance(a_, tvm.ir.expr.Constant) for a_ in ncall.args)):
                break
            inner.add(var)
            var = nxt
        inner.add(var)
        body = [v for v in order if v in inner]
        pairs.append(_Pair(var, mm.args[0], mm, (wa, wb), a, b, body, wide, pre))
        taken |= group | {var}
    return pairs


@mutator
class _Rewrite(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, pairs: list[_Pair], bound: dict,
                 weights: weight_arrays.DerivedConstants) -> None:
        super().__init__(mod)
        self.pairs = {p.root: p for p in pairs}
        self.bound = bound
        self.weights = weights  # the interleaved weights, shared by the functions

    def _weight(self, p: _Pair) -> relax.Constant:
        return self.weights.get(weight_arrays.identity(*p.halves),
                                lambda: weight_arrays.interleave_columns(*p.halves), keep=p.halves)

    def _group_func(self, p: _Pair) -> tuple[relax.Function, list[relax.Expr]]:
        """``fn(x, W, operands…) = f(even(x·W), odd(x·W))`` marked Primitive; its arguments."""
        params, args, vmap = [], [], {}

        def operand(e: relax.Expr, name: str | None = None) -> relax.Expr:
            """Inside the function: a mapped var, or a new parameter for an outside tensor."""
            if isinstance(e, relax.Var) and e in vmap:
                return vmap[e]
            if not isinstance(e, relax.Var | tvm.ir.expr.Constant):
                return e  # PrimValue, shapes: as they are
            param = relax.Var(name or f"p{len(params)}", e.ty)
            params.append(param)
            args.append(e)
            if isinstance(e, relax.Var):
                vmap[e] = param
            return param

        def replay(var: relax.Var) -> relax.Var:
            call = self.bound[var]
            new = relax.Call(call.op, [operand(a) for a in call.args], call.attrs, call.ty_args)
            vmap[var] = (bb.emit_output if var.same_as(p.root) else bb.emit)(new)
            return vmap[var]

        bb = relax.BlockBuilder()
        with bb.function("pair_gemm", attrs={"Primitive": True}, private=True):
            with bb.dataflow():
                x, w = operand(p.x, "x"), operand(self._weight(p), "w")
                z = bb.emit(relax.op.matmul(x, w, out_dtype=p.matmul.attrs.out_dtype))
                if p.wide is not None:
                    vmap[p.wide] = z
                    for var in p.pre:
                        z = replay(var)
                axis, n2 = len(known_shape(z)) - 1, 2 * int(p.halves[0].shape[1])
                vmap[p.a] = bb.emit(relax.op.strided_slice(z, [axis], [0], [n2], [2]))
                vmap[p.b] = bb.emit(relax.op.strided_slice(z, [axis], [1], [n2], [2]))
                for var in p.body:
                    out = replay(var)
            bb.emit_func_output(out, params)
        return bb.get()["pair_gemm"], args

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
        mod = mod.clone()  # assigned into below: not the caller's module
        weights = weight_arrays.DerivedConstants()
        for gvar, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or func.attrs and func.attrs.get("Primitive"):
                continue
            pairs = _find(func)
            if not pairs:
                continue
            bound = {b.var: b.value for blk in func.body.blocks for b in blk.bindings}
            rewriter = _Rewrite(mod, pairs, bound, weights)
            new = rewriter.visit_expr(func)
            mod = rewriter.builder_.get()
            mod[gvar] = relax.analysis.remove_all_unused(new)
        return mod
