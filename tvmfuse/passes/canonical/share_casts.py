"""One cast per (value, dtype): torch.export writes every ``x.float()`` as its own ``astype``.

    a = astype(x, t); …; b = astype(x, t)      →      a = astype(x, t); … uses of b read a

HF's fp16 RMSNorm (``x.float().pow(2).mean(-1)`` … ``x.float() * rsqrt(v + eps)``) exports from
torch as two casts of ``x``, from ONNX as one Cast: the norm pattern, which needs one ``x`` on both
paths, then sees the same graph from both frontends. Only dataflow vars are shared (a function
output keeps its binding). Any position in the canonical list; runs first so the passes after it
see single casts.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._util import is_op
from ._common import rewrite_relax_functions


@mutator
class _Share(PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.seen: dict = {}

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        self.seen = {}  # a cast is shared only within its block
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if is_op(value, "relax.astype") and isinstance(binding.var, relax.DataflowVar):
            src = self.visit_expr(value.args[0])
            key = (src, str(value.attrs.dtype))
            if key in self.seen:
                self.set_var_remap(binding.var, self.seen[key])
                return
            super().visit_var_binding_(binding)
            self.seen[key] = self.visit_expr(binding.var)  # the var the binding was emitted as
            return
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.ShareCasts")
class ShareCasts:
    """Identical ``astype(x, t)`` bindings in one dataflow block → one."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_relax_functions(mod, lambda m, f: _Share(m).visit_expr(f))
