"""Mixed precision: matmuls/attention in fp16 or bf16, accumulation in fp32.

Runs TVM's ``ToMixedPrecision`` (which knows the fp16-safe ops and keeps accumulators at fp32),
then lets NormGemmPrologue's fp32 epilogues read the GEMM accumulator instead of the half copy
ToMixedPrecision stores (:mod:`.norm_epilogue_fp32`); for ``bfloat16`` every fp16 cast and
constant it introduced is then retyped to bf16. Model inputs and outputs keep their float32
signature, as TensorRT's and torch.autocast's do.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .norm_epilogue_fp32 import NormEpilogueFp32


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
        mod = relax.transform.ToMixedPrecision(out_dtype="float32")(mod)
        # acc → half → fp32 before a norm epilogue would round it and split it from the GEMM.
        mod = NormEpilogueFp32()(mod)
        if self.dtype == "bfloat16":
            mod = mod.clone()  # a pass above may hand back its input unchanged: not the caller's
            for gvar, func in list(mod.functions.items()):
                if isinstance(func, relax.Function):
                    mod[gvar] = _Fp16ToBf16().visit_expr(func)
            mod = relax.transform.Normalize()(mod)
        return mod
