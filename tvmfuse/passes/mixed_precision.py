"""Mixed precision: matmuls/attention in fp16 or bf16, accumulation in fp32.

Runs TVM's ``ToMixedPrecision`` (which knows the fp16-safe ops and keeps accumulators at fp32),
then lets NormGemmPrologue's fp32 epilogues read the GEMM accumulator instead of the half copy
ToMixedPrecision stores (:mod:`.norm_epilogue_fp32`); for ``bfloat16`` every fp16 cast and
constant it introduced is then retyped to bf16. Model inputs and outputs keep their float32
signature, as TensorRT's and torch.autocast's do.

Kernels already lowered to TIR before this pass (NormGemmPrologue's ``call_tir(layer_norm_stats,
(x,))``) keep the dtypes their PrimFunc was written for. ToMixedPrecision cannot do that itself:
when ``x`` becomes fp16 (the residual sum of fp16 GEMMs, from a model's second norm on) it tries
to cast every argument of the ``call_tir`` back, the PrimFunc included, and fails with "Expected
TensorType, but got R.Callable(...)". So each float tensor argument of a ``call_tir`` is first
bound to ``astype(x, dtype of x)``: ToMixedPrecision then reads ``x`` in whatever dtype it chose
and casts it back to the PrimFunc's; the casts left as no-ops are removed afterwards. A statistics
PrimFunc whose input ends up as ``astype(h, f32)`` of a half tensor ``h`` is then made again for
``h`` (it upcasts each element itself): the GEMM that reads ``h`` can compute the statistics.

ToMixedPrecision stores half only what a matmul makes and what follows from half operands alone,
so two values that stand for half ones would keep a decoder's residual stream fp32 (a cast kernel
before each GEMM, the statistics apart from it, fp32 RoPE: 23 kernels for a 2-layer transformers
Llama in fp32 against 14 for the same model after ``.half()``):

* the embedding gather: ``take`` has no policy, so it is never narrowed;
* a norm epilogue's result ``rstd ⊙ acc``: fp32 (``rstd`` is), where the matmul it replaced would
  have been stored half.

Each is made half first and handed to ToMixedPrecision as ``wrap_param(half value, float32)``, the
op it takes a half tensor of an fp32 program through: ``take(astype(E, f16), idx)`` for a constant
table whose values fit fp16, ``astype(epilogue, f16)`` unless only the function's result reads it.
The adds after them are then half, as in the model converted with ``.half()``. Model inputs stay
fp32 where they enter (an fp32 mask of ``finfo(float32).min`` would become -inf).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from . import weight_arrays
from ._util import binding_users, is_op
from .norm_epilogue_fp32 import NormEpilogueFp32
from .norm_gemm import row_stats_params, stats_function
from .simplify import drop_noop_casts

_TIR_CALLS = ("relax.call_tir", "relax.call_tir_inplace", "relax.call_dps_packed")
_FP16_MAX = 65504.0


@mutator
class _PinTirArgs(PyExprMutator):
    """``call_tir(f, (x, …))`` → ``call_tir(f, (astype(x, dtype of x), …))`` for float tensors x."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not any(is_op(call, name) for name in _TIR_CALLS) or not isinstance(call.args[1], relax.Tuple):
            return call
        fields = [self.builder_.emit(relax.op.astype(a, a.ty.dtype))
                  if isinstance(a.ty, relax.TensorType) and str(a.ty.dtype).startswith(("float", "bfloat"))
                  else a for a in call.args[1].fields]
        return relax.Call(call.op, [call.args[0], relax.Tuple(fields), *call.args[2:]], call.attrs,
                          call.ty_args)


def _fits_fp16(arr: np.ndarray) -> bool:
    """Every value finite in fp16 (no temporary the size of ``arr``; NaN compares false)."""
    return arr.size == 0 or bool(arr.max() <= _FP16_MAX and arr.min() >= -_FP16_MAX)


def _stats_params(mod: tvm.IRModule) -> dict:
    """Statistics PrimFunc (GlobalVar) → ``(eps, centered)``, for NormGemmPrologue's ones only."""
    found = {gv: row_stats_params(f) for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    return {gv: params for gv, params in found.items() if params is not None}


def _norm_epilogue_ends(stats: dict, func: relax.Function) -> set[relax.Var]:
    """The results of NormGemmPrologue's epilogues in ``func``: ``multiply(acc, rstd)`` (RMSNorm),
    ``add(multiply(subtract(acc, …), rstd), shift)`` (LayerNorm), ``acc`` an fp32 matmul and
    ``rstd`` a statistics call's output. They stand for the matmul the norm was folded into; those
    read only by (views of) the function's result are left out (fp32 out, no extra cast)."""
    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    users = binding_users(func)

    def is_stats(v) -> bool:
        call = bound.get(v)
        if isinstance(call, relax.TupleGetItem):
            call = bound.get(call.tuple_value)
        return is_op(call, "relax.call_tir") and call.args[0] in stats

    def is_acc(v) -> bool:
        call = bound.get(v)
        if is_op(call, "relax.subtract"):
            call = bound.get(call.args[0])
        return is_op(call, "relax.matmul") and str(call.attrs.out_dtype) == "float32"

    def toward_output(value) -> bool:  # tuples, and ops of one tensor: views, scalings by
        # constants, Cohere's logit scale, Gemma-2's tanh soft cap
        return isinstance(value, relax.Tuple) or isinstance(value, relax.Call) and sum(
            isinstance(a, relax.Var) for a in value.args) == 1

    def only_output(v) -> bool:  # read only on the way to the function's result: fp32 stays
        if not isinstance(v, relax.DataflowVar):
            return True
        return all(toward_output(bound[u]) and only_output(u) for u in users.get(v, []))

    ends = set()
    for var, value in bound.items():
        if not (is_op(value, "relax.multiply") and any(
                is_stats(b) and is_acc(a) for a, b in (value.args, value.args[::-1]))):
            continue
        after = users.get(var, [])
        if len(after) == 1 and is_op(bound.get(after[0]), "relax.add") \
                and isinstance(bound[after[0]].args[1], tvm.ir.expr.Constant):
            var = after[0]  # LayerNorm's β·W shift
        if not only_output(var):
            ends.add(var)
    return ends


@mutator
class _HalfSources(PyExprMutator):
    """Values ToMixedPrecision would leave fp32 but that stand for half ones, made half and handed
    to it through ``wrap_param`` (bound to dataflow vars: a function output keeps its type):

    * ``take(E, idx)`` → ``take(astype(E, float16), idx)`` for a constant fp32 table whose values
      fit fp16 (ToMixedPrecision never narrows a gather);
    * a norm epilogue's result (:func:`_norm_epilogue_ends`) → ``astype(·, float16)``: the matmul
      it replaced would have been stored half."""

    def __init__(self, ends: set) -> None:
        super().__init__()
        self.ends = ends

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        call = binding.value
        table = call.args[0] if is_op(call, "relax.take") else None
        ty = binding.var.ty
        if not (isinstance(binding.var, relax.DataflowVar) and isinstance(ty, relax.TensorType)
                and str(ty.dtype) == "float32"):
            half = None
        elif isinstance(table, tvm.ir.expr.Constant) and _fits_fp16(weight_arrays.array(table)):
            half = relax.op.take(relax.op.astype(table, "float16"), self.visit_expr(call.args[1]),
                                 call.attrs.axis, call.attrs.mode)
        elif binding.var in self.ends:
            half = relax.op.astype(self.visit_expr(call), "float16")
        else:
            half = None
        if half is None:
            super().visit_var_binding_(binding)
            return
        half = self.builder_.emit(half)
        self.builder_.emit_normalized(relax.VarBinding(
            binding.var, self.builder_.normalize(relax.op.wrap_param(half, "float32"))))


def _stats_inputs(mod: tvm.IRModule, stats: dict) -> dict:
    """Statistics PrimFunc (of ``stats``) → ``[(call, half input or None)]`` over its calls: the
    half tensor ``h`` of an argument ``astype(h, float32)``, else None."""
    sites: dict = {}
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
        for call in bound.values():
            if not (is_op(call, "relax.call_tir") and isinstance(call.args[0], tvm.ir.GlobalVar)
                    and isinstance(call.args[1], relax.Tuple) and len(call.args[1].fields) == 1):
                continue
            if call.args[0] not in stats:
                continue
            cast = bound.get(call.args[1].fields[0])
            half = cast.args[0] if is_op(cast, "relax.astype") and str(cast.attrs.dtype) == "float32" \
                and str(cast.args[0].ty.dtype) in ("float16", "bfloat16") else None
            sites.setdefault(call.args[0], []).append((call, half))
    return sites


@mutator
class _ReadHalf(PyExprMutator):
    """The listed calls with their argument replaced by the half tensor and their callee by the
    PrimFunc made for it."""

    def __init__(self, halves: dict, callees: dict) -> None:
        super().__init__()
        self.halves, self.callees = halves, callees  # call → half input; old → new GlobalVar

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        half = next((h for c, h in self.halves.items() if c.same_as(call)), None)
        if half is None:
            return super().visit_call_(call)
        return relax.Call(call.op, [self.callees[call.args[0]], relax.Tuple([self.visit_expr(half)]),
                                    *call.args[2:]], call.attrs, call.ty_args)


def _stats_of_half(mod: tvm.IRModule) -> tvm.IRModule:
    """A statistics PrimFunc every call of which reads ``astype(h, float32)`` of half tensors of one
    dtype is made again for that dtype, under its name (it upcasts each element itself: the same
    numbers), and the calls read ``h``. The GEMM that reads ``h`` can then compute them
    (Sm90GemmRowStats)."""
    made, halves, stats = {}, {}, _stats_params(mod)
    for gvar, uses in _stats_inputs(mod, stats).items():
        dtypes = {None if h is None else str(h.ty.dtype) for _, h in uses}
        if len(dtypes) != 1 or None in dtypes:
            continue
        old = mod[gvar]
        eps, centered = stats[gvar]
        x_ty = relax.TensorType(list(old.params[0].shape), dtypes.pop())
        made[gvar] = stats_function(x_ty, eps, centered).with_attrs(old.attrs)
        halves.update(dict(uses))
    if not made:
        return mod
    bb = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv not in made},
                                         attrs=mod.attrs, global_infos=mod.global_infos))
    callees = {gv: bb.add_func(func, gv.name_hint) for gv, func in made.items()}
    mod = _map_functions(bb.get(), _ReadHalf(halves, callees).visit_expr)
    return relax.transform.DeadCodeElimination(
        [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, relax.Function)])(mod)


@mutator
class _FoldScalarCasts(PyExprMutator):
    """``astype(c, float16)`` of a one-element constant → the fp16 constant: LegalizeOps writes a
    scalar constant into its kernel as an immediate, a cast of one is a tensor parameter."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        const = call.args[0] if is_op(call, "relax.astype") else None
        if isinstance(const, tvm.ir.expr.Constant) and str(call.attrs.dtype) == "float16" \
                and str(const.ty.dtype) == "float32" and const.value.numpy().size == 1:
            return relax.const(const.value.numpy().astype("float16"), "float16")
        return call


@mutator
class _Fp16ToBf16(PyExprMutator):
    """``astype(x, float16)`` → ``astype(x, bfloat16)``; fp16 constants → bf16 constants."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op == tvm.ir.Op.get("relax.astype") and call.attrs.dtype == "float16":
            return relax.op.astype(call.args[0], "bfloat16")
        return call

    def visit_generic_const_(self, const: tvm.ir.expr.Constant) -> relax.Expr:  # 0.27 name
        if isinstance(const.value, tvm.runtime.Tensor) and const.value.dtype == "float16":
            import ml_dtypes

            arr = const.value.numpy().astype(np.float32).astype(ml_dtypes.bfloat16)
            return relax.const(tvm.runtime.tensor(arr), "bfloat16")
        return const


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.MixedPrecision")
class MixedPrecision:
    """Convert a float32 model to ``dtype`` (float16 | bfloat16) compute with fp32 accumulation."""

    def __init__(self, dtype: str) -> None:
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"mixed precision dtype must be float16 or bfloat16, not {dtype}")
        self.dtype = dtype

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = relax.transform.ConvertToDataflow()(mod)
        mod = _map_functions(mod, _PinTirArgs().visit_expr)
        stats = _stats_params(mod)
        mod = _map_functions(mod, lambda f: _HalfSources(_norm_epilogue_ends(stats, f)).visit_expr(f))
        mod = relax.transform.ToMixedPrecision(out_dtype="float32")(mod)
        mod = _map_functions(mod, _FoldScalarCasts().visit_expr)
        # bf16 before the cast clean-up: a bf16 module's own casts then meet bf16 ones, not fp16
        if self.dtype == "bfloat16":
            mod = relax.transform.Normalize()(_map_functions(mod, _Fp16ToBf16().visit_expr))
        # wrap_param leaves ``v = v16`` aliases behind: the cast rewrites below match through them.
        mod = relax.transform.CanonicalizeBindings()(mod)
        mod = _map_functions(mod, drop_noop_casts)
        # acc → half → fp32 before a norm epilogue would round it and split it from the GEMM.
        mod = NormEpilogueFp32()(mod)
        # The dtypes are final: statistics of a half tensor read it, not an fp32 copy of it.
        return _stats_of_half(mod)


def _map_functions(mod: tvm.IRModule, fn) -> tvm.IRModule:
    """A new module with ``fn`` applied to every Relax function of ``mod``."""
    funcs = {gv: fn(f) if isinstance(f, relax.Function) else f for gv, f in mod.functions.items()}
    return tvm.IRModule(funcs, attrs=mod.attrs, global_infos=mod.global_infos)
