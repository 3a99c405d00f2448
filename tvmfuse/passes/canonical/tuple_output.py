"""``main`` returns a tuple, as torch.export's import does: ``gv = op(…); return gv`` →
``lv = op(…); gv = (lv,); return gv``.

The ONNX importer binds the last op of a one-output model to the function's output var. A
reshape that SinkReshape later moves to the end (the 3-D view of a GEMM folded by
FoldMatmulLeadingDims) then lands on that var, where RewriteDataflowReshape cannot make it a view
(a function output must not alias a parameter), and costs a copy kernel. Bound to a dataflow var
inside the tuple it stays a view, as for torch models; UnwrapSingleOutput returns the tensor
again at the end of the pipeline. Sits after FoldMatmulLeadingDims; the signature the runtime
checks is taken from the imported module, not from this one.
"""

from __future__ import annotations

import tvm
from tvm import relax


def _wrap(func: relax.Function) -> relax.Function:
    ret = func.body.body
    blocks = list(func.body.blocks)
    if not (isinstance(func.ret_ty, relax.TensorType) and isinstance(ret, relax.Var) and blocks
            and isinstance(blocks[-1], relax.DataflowBlock) and blocks[-1].bindings
            and blocks[-1].bindings[-1].var.same_as(ret)):
        return func
    *kept, last = blocks[-1].bindings
    inner = relax.DataflowVar(ret.name, ret.ty)
    out = relax.Var(ret.name, relax.TupleType([ret.ty]))
    block = relax.DataflowBlock([*kept, relax.VarBinding(inner, last.value),
                                 relax.VarBinding(out, relax.Tuple([inner]))])
    return relax.Function(func.params, relax.SeqExpr([*blocks[:-1], block], out),
                          relax.TupleType([func.ret_ty]), func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.TupleOutput")
class TupleOutput:
    """A ``main`` returning one tensor var bound in a dataflow block returns a 1-tuple of it."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if "main" not in [gv.name_hint for gv in mod.functions]:
            return mod
        gvar = mod.get_global_var("main")
        new = _wrap(mod[gvar]) if isinstance(mod[gvar], relax.Function) else mod[gvar]
        if new.same_as(mod[gvar]):
            return mod
        out = mod.clone()
        out[gvar] = new
        return relax.transform.Normalize()(out)
