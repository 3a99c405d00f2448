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
and casts it back to the PrimFunc's; the casts left as no-ops are removed afterwards.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._util import is_op
from .norm_epilogue_fp32 import NormEpilogueFp32
from .simplify import drop_noop_casts

_TIR_CALLS = ("relax.call_tir", "relax.call_tir_inplace", "relax.call_dps_packed")


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


@mutator
class _Fp16ToBf16(PyExprMutator):
    """``astype(x, float16)`` → ``astype(x, bfloat16)``; fp16 constants → bf16 constants."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op == tvm.ir.Op.get("relax.astype") and call.attrs.dtype == "float16":
            return relax.op.astype(call.args[0], "bfloat16")
        return call

    def visit_constant_(self, const: tvm.ir.expr.Constant) -> relax.Expr:
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
        mod = relax.transform.ToMixedPrecision(out_dtype="float32")(mod)
        mod = _map_functions(mod, drop_noop_casts)
        # acc → half → fp32 before a norm epilogue would round it and split it from the GEMM.
        mod = NormEpilogueFp32()(mod)
        if self.dtype == "bfloat16":
            mod = relax.transform.Normalize()(_map_functions(mod, _Fp16ToBf16().visit_expr))
        return mod


def _map_functions(mod: tvm.IRModule, fn) -> tvm.IRModule:
    """A new module with ``fn`` applied to every Relax function of ``mod``."""
    funcs = {gv: fn(f) if isinstance(f, relax.Function) else f for gv, f in mod.functions.items()}
    return tvm.IRModule(funcs, attrs=mod.attrs, global_infos=mod.global_infos)
