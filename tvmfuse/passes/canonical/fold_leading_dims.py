"""N-D × 2-D matmuls become 2-D GEMMs: the leading dims fold into M (torch.export's Linear form).

    y = matmul(x, w) [→ astype(·, t)] [→ add(·, b) | add(b, ·)]
      → reshape(add(astype(matmul(reshape(x, (M, K)), w), t), b), (d_0, …, d_{n-2}, N))

``x`` (d_0, …, d_{n-2}, K) with n ≥ 3 (dims may be symbolic), ``w`` (K, N), M = d_0·…·d_{n-2},
``b`` of shape (N,) or a scalar. ONNX exports multiply (B, S, K) activations by a (K, N) weight
directly and add the bias after; torch.export writes reshape → 2-D matmul → bias add → reshape.
The 2-D form is what the GEMM passes (HorizontalGemm, NormGemmPrologue, PairGemm, SinkReshape)
and the GEMM schedule rules take (sm90's wgmma rule refuses a batched GEMM block). The bias add
(and a cast between, as HalfMatmulAccumulate writes for half GEMMs) moves inside the reshape when
the matmul has no other user, so HorizontalGemm sees ``add(matmul, bias)`` as it does for torch.

Runs after HalfMatmulAccumulate and UpcastMatmul (the matmul it folds is the final one) and
before every pattern pass.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.sym.analyzer import Analyzer

from .._util import const_array, is_op
from ._common import is_gemm, ndim_of, rewrite_relax_functions


def _users(func: relax.Function) -> dict:
    """Dataflow var → the vars whose bound values use it (in the dataflow blocks of ``func``)."""
    users: dict = {}
    for block in func.body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            continue
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                users.setdefault(var, []).append(binding)
    return users


def _is_bias(expr: relax.Expr, n) -> bool:
    """A scalar, or a vector of length ``n`` (it broadcasts over the last axis only)."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return False
    dims = list(ty.shape.values)
    return not dims or (len(dims) == 1 and Analyzer().can_prove_equal(dims[0], n))


@mutator
class _Fold(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, func: relax.Function) -> None:
        super().__init__(mod)
        self.users = _users(func)
        self.absorbed: set = set()
        self.defined = set(func.params)  # vars bound so far: a bias must be one of them

    def _epilogue(self, var: relax.Var, n) -> list[relax.VarBinding]:
        """The cast / bias-add bindings that follow ``var`` as its only user, in order."""
        chain = []
        for op in ("relax.astype", "relax.add"):
            uses = self.users.get(var, [])
            if not isinstance(var, relax.DataflowVar) or len(uses) != 1:
                break
            if not is_op(uses[0].value, op):
                continue
            value = uses[0].value
            if op == "relax.add":
                other = value.args[1] if value.args[0].same_as(var) else value.args[0]
                defined = const_array(other) is not None or other in self.defined
                if other.same_as(var) or not defined or not _is_bias(other, n):
                    break
            chain.append(uses[0])
            var = uses[0].var
        return chain

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.absorbed:
            return
        self.defined.add(binding.var)
        value = binding.value
        if not is_gemm(value) or ndim_of(value.args[0]) < 3 or value.args[0].ty.shape is None:
            super().visit_var_binding_(binding)
            return
        x, w = (self.visit_expr(arg) for arg in value.args)
        *lead, k = x.ty.shape.values
        n = w.ty.shape.values[1]
        m = lead[0]
        for d in lead[1:]:
            m = m * d
        m = Analyzer().simplify(m)
        y = self.builder_.emit(relax.op.matmul(self.builder_.emit(relax.op.reshape(x, [m, k])), w,
                                               out_dtype=value.attrs.out_dtype))
        last = binding.var
        for step in self._epilogue(binding.var, n):
            call = step.value
            if is_op(call, "relax.astype"):
                y = self.builder_.emit(relax.op.astype(y, call.attrs.dtype))
            else:
                bias = call.args[1] if call.args[0].same_as(last) else call.args[0]
                y = self.builder_.emit(relax.op.add(y, self.visit_expr(bias)))
            self.absorbed.add(step.var)
            last = step.var
        # the chain's last var (a function output, maybe) is bound to the reshape back
        back = self.builder_.normalize(relax.op.reshape(y, [*lead, n]))
        self.builder_.emit_normalized(relax.VarBinding(last, back))


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.FoldMatmulLeadingDims")
class FoldMatmulLeadingDims:
    """``(…, M, K) · (K, N)`` → reshape → ``(M', K) · (K, N)`` → reshape, bias add inside."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_relax_functions(mod, lambda m, f: _Fold(m, f).visit_expr(f))
