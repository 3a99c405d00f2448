"""Lowering of ``R.nn.attention`` / ``R.nn.attention_bias`` to one tvmfuse attention kernel.

Stock 0.27 legalisation writes the Sq×Skv scores, masks them with ``trilu`` and has no GQA
(it reshapes K/V with the query head count). Here the call becomes::

    R.call_tir(attention_primfunc(AttentionSpec(...), Target.current()), (q, k, v[, bias]), out)

with the spec read off the call's types and attributes (scale defaults to 1/sqrt(D) as in TVM).
Only calls the spec cannot describe (symbolic shapes, value head dim != query head dim, sliding
window) go to the stock rule, which rejects GQA and windows itself.

Also repairs ``ToMixedPrecision`` for attention: 0.27's ``FInferMixedPrecision`` of both ops
rebuilds the call as ``attention(q, k, v)``, silently dropping bias, scale and causal mask.
:func:`register_mixed_precision_fix` keeps them (inputs and bias are cast to fp16/bf16, the
output stays in that dtype and is cast back by ToMixedPrecision where needed).
"""

from __future__ import annotations

import math

import tvm
from tvm import relax

from ..errors import CompileError
from ._util import static_shape

_OPS = ("relax.nn.attention", "relax.nn.attention_bias")


def attention_spec(call: relax.Call):
    """The :class:`AttentionSpec` of an attention call, or None when the spec cannot express it."""
    from ..schedules.attention import AttentionSpec

    q, k, v = (static_shape(a) for a in call.args[:3])
    bias = static_shape(call.args[3]) if len(call.args) > 3 else None
    if None in (q, k, v) or (len(call.args) > 3 and bias is None) or v[3] != q[3]:
        return None
    if call.attrs.window_size is not None:
        return None
    scale = call.attrs.scale
    scale = float(scale.value) if scale is not None else 1.0 / math.sqrt(q[3])
    return AttentionSpec(
        batch=q[0], q_len=q[1], kv_len=k[1], q_heads=q[2], kv_heads=k[2], head_dim=q[3],
        dtype=str(call.args[0].ty.dtype), scale=scale, causal=call.attrs.causal_mask or "none",
        bias_shape=tuple(bias) if bias is not None else None,
        bias_dtype=str(call.args[3].ty.dtype) if bias is not None else None,
        out_dtype=str(call.ty.dtype))


def legalize_attention(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``LegalizeOps`` rule for both attention ops (see the module docstring)."""
    from tvm.relax.transform.legalize_ops import nn as stock

    from ..schedules.attention import attention_primfunc

    spec = attention_spec(call)
    if spec is None:
        if call.attrs.window_size is not None:
            raise CompileError(f"sliding-window attention (window {call.attrs.window_size}) is not "
                               f"supported: {call.op.name} with q {call.args[0].ty}")
        rule = stock._nn_attention_bias if len(call.args) > 3 else stock._nn_attention
        return rule(bb, call)
    target = tvm.target.Target.current() or tvm.target.Target("llvm")  # no target: the host CPU
    func = attention_primfunc(spec, target)
    gvar = bb.add_func(func, "attention_bias" if spec.bias_shape else "attention")
    return relax.call_tir(gvar, list(call.args), call.ty)


def _keep_attrs(call: relax.Call, _out_dtype) -> relax.Call:
    a = call.attrs
    bias = call.args[3] if len(call.args) > 3 else None
    return relax.op.nn.attention(call.args[0], call.args[1], call.args[2], bias, a.scale,
                                 a.causal_mask, a.window_size)


def register_mixed_precision_fix() -> None:
    """Make ToMixedPrecision keep attention's bias, scale and causal mask (0.27 drops them)."""
    for name in _OPS:
        tvm.ir.register_op_attr(name, "FInferMixedPrecision", _keep_attrs, level=11)
