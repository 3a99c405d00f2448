"""Last-token logits: an entry point returns each sequence's last logits (B, V), not (B, S, V).

Generation reads only the last real position's logits; returning them alone keeps the (B, S, V)
tensor out of the caller's memory. Prompts are right-padded (:mod:`tvmfuse.runtime.lm`), so that
position differs per sequence: a function with S > 1 gains the parameter ``last`` (B,) int32 after
its own and returns ``logits[b, last[b]]``; with S = 1 (decode) it returns ``logits[:, 0]``.
Input: a function whose result is ``logits`` or ``(logits,)`` with static shape (B, S, V). Sits
before the KV-cache rewrite (which appends the cache parameters after ``last``), before lowering.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..errors import CompileError


def _last(func: relax.Function, name: str) -> relax.Function:
    body = func.body
    result = body.body
    bb = relax.BlockBuilder()
    tail: list[relax.VarBinding] = []
    # inside the last dataflow block when there is one: its reshapes become views there
    # (RewriteDataflowReshape), where bindings after the block would each be a copy kernel
    dataflow = bool(body.blocks) and isinstance(body.blocks[-1], relax.DataflowBlock)

    def bind(name: str, value: relax.Expr, last: bool = False) -> relax.Var:
        value = bb.normalize(value)
        var = (relax.DataflowVar if dataflow and not last else relax.Var)(name, value.ty)
        tail.append(relax.VarBinding(var, value))
        return var

    # (logits,): its field, read through the tuple
    one = isinstance(result.ty, relax.TupleType) and len(result.ty.fields) == 1
    logits = bind("logits", relax.TupleGetItem(result, 0)) if one else result
    ty = logits.ty
    if not isinstance(ty, relax.TensorType) or ty.ndim != 3:
        raise CompileError(f"compile_lm: {name} returns {ty}, expected logits (batch, seq, vocab)")
    b, s, v = (int(d) for d in ty.shape.values)
    params = list(func.params)
    if s == 1:  # the one position: a view
        out = bind("last_logits", relax.op.reshape(logits, [b, v]), last=True)
    else:  # row b·S + last[b] of the (B·S, V) logits
        last = relax.Var("last", relax.TensorType([b], "int32"))
        params.append(last)
        starts = bind("row_starts", relax.op.arange(0, b * s, s, "int32"))
        rows = bind("last_rows", relax.op.add(starts, last))
        flat = bind("flat_logits", relax.op.reshape(logits, [b * s, v]))
        out = bind("last_logits", relax.op.take(flat, rows, axis=0, mode="clip"), last=True)  # in bounds
    if dataflow:
        blocks = [*body.blocks[:-1], relax.DataflowBlock([*body.blocks[-1].bindings, *tail])]
    else:
        blocks = [*body.blocks, relax.BindingBlock(tail)]
    new_body = relax.SeqExpr(blocks, out)
    return relax.Function(params, new_body, out.ty, func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.llm.LastTokenLogits")
class LastTokenLogits:
    """Every Relax function returns its last position's logits (module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod.clone()
        for gv, func in mod.functions.items():
            if isinstance(func, relax.Function):
                out[gv] = _last(func, gv.name_hint)
        return relax.transform.Normalize()(out)  # the new SeqExpr gets its type
