"""Every floating-point GEMM names an fp32 accumulator: the form torch.export gives.

    matmul(a, b) → half                     →  astype(matmul(a, b, out_dtype="float32"), half)
    matmul(a, b) → float32, out_dtype unset →  matmul(a, b, out_dtype="float32")

``a`` (..., M, K), ``b`` (K, N), both float16 or both bfloat16 (half) or both float32. The ONNX
importer writes MatMul with ``out_dtype`` unset; on half operands that legalises to a half-precision
accumulator, which neither tensor-core GEMM rule takes (sm80 and sm90 need fp32 accumulators) and
which torch, cuBLAS and onnxruntime's CUDA kernels do not use either (they accumulate in fp32 and
round once). tvmfuse's torch importer already writes the right-hand form (frontend/torch_fixes.py).

Only GEMMs (2-D right operand) are rewritten; batched products (attention's QKᵀ and P·V) keep
their spelling for FuseAttention. Runs before UpcastMatmul and FoldMatmulLeadingDims, which then
see one matmul spelling.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._common import HALF, dtype_of, is_gemm, rewrite_relax_functions


@mutator
class _Accumulate(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_gemm(call):
            return call
        a, b = call.args
        dtype = dtype_of(a)
        if dtype != dtype_of(b) or dtype not in (*HALF, "float32"):
            return call
        if dtype_of(call) != dtype or str(call.attrs.out_dtype) == "float32":
            return call  # already fp32 out (or an integer/other out_dtype: not ours)
        acc = relax.op.matmul(a, b, out_dtype="float32")
        return acc if dtype == "float32" else relax.op.astype(self.builder_.emit(acc), dtype)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.HalfMatmulAccumulate")
class HalfMatmulAccumulate:
    """GEMMs without an fp32 ``out_dtype`` get one (half results are cast back)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_relax_functions(mod, lambda m, f: _Accumulate(m).visit_expr(f))
