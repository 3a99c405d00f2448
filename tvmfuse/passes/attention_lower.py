"""Lowering of ``R.nn.attention`` / ``R.nn.attention_bias`` to one tvmfuse attention kernel.

Stock 0.27 legalisation writes the Sq×Skv scores, masks them with ``trilu`` and has no GQA
(it reshapes K/V with the query head count). Here the call becomes::

    R.call_tir(attention_primfunc(AttentionSpec(...), Target.current()), (q, k, v[, bias]), out)

with the spec read off the call's types and attributes (scale defaults to 1/sqrt(D) as in TVM).
Where no kernel covers the spec (the CUDA kernels take fp16/bf16 with head dim 64/128 only; they
raise ValueError otherwise) the call is decomposed back into Relax ops, GQA and causal mask kept
(:func:`_decomposed`; this one writes S to memory, like the graph it came from). ``window_size``
(sliding-window attention) is the spec's ``window``: key j visible to query i iff
``i + off − w < j ≤ i + off`` (``off`` the causal offset; FlashAttention's / TVM's CUTLASS meaning,
see ``kernels/attention/spec.py``); the kernels skip the KV tiles outside the band. A window without
a causal mask is an error (TVM gives it no meaning). On CUDA targets the window kernels can be
switched off (:func:`gpu_window_gate`): with ``Options(gpu_window_attention=False)`` a call with a
window is decomposed as above. Calls the
spec cannot describe (symbolic shapes) go to the stock rule, which rejects GQA itself. A value head
dim that differs from the query's (multi-head latent attention) is the spec's ``v_head_dim``; on
CUDA targets it is decomposed unless ``Options(gpu_mla_attention=True)`` (:func:`gpu_value_dim_gate`).

Also repairs ``ToMixedPrecision`` for attention: 0.27's ``FInferMixedPrecision`` of both ops
rebuilds the call as ``attention(q, k, v)``, silently dropping bias, scale and causal mask.
:func:`register_mixed_precision_fix` keeps them (inputs and bias are cast to fp16/bf16, the
output stays in that dtype and is cast back by ToMixedPrecision where needed).
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.transform.legalize_ops import nn as stock

from ..attrs import parse_causal_attr
from ..errors import CompileError
from ..kernels.attention.spec import AttentionSpec
from ..options import current_options
from ..rules.attention import attention_primfunc
from ._util import static_shape

_OPS = ("relax.nn.attention", "relax.nn.attention_bias")


def attention_spec(call: relax.Call):
    """The :class:`AttentionSpec` of an attention call, or None when the spec cannot express it."""
    q, k, v = (static_shape(a) for a in call.args[:3])
    bias = static_shape(call.args[3]) if len(call.args) > 3 else None
    if None in (q, k, v) or (len(call.args) > 3 and bias is None):
        return None
    window = call.attrs.window_size
    causal, softcap = parse_causal_attr(call.attrs.causal_mask)
    if window is not None and (causal == "none" or int(window) < 1):
        raise CompileError(f"{call.op.name}: window_size {window} needs causal_mask TopLeft or "
                           f"BottomRight and a window >= 1 (causal_mask is {causal!r}), q {q}")
    scale = call.attrs.scale
    scale = float(scale.value) if scale is not None else 1.0 / math.sqrt(q[3])
    return AttentionSpec(
        batch=q[0], q_len=q[1], kv_len=k[1], q_heads=q[2], kv_heads=k[2], head_dim=q[3],
        dtype=str(call.args[0].ty.dtype), scale=scale, causal=causal,
        bias_shape=tuple(bias) if bias is not None else None,
        bias_dtype=str(call.args[3].ty.dtype) if bias is not None else None,
        out_dtype=str(call.ty.dtype), window=int(window) if window is not None else None,
        softcap=softcap, v_head_dim=v[3] if v[3] != q[3] else None)


def legalize_attention(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``LegalizeOps`` rule for both attention ops (see the module docstring)."""
    spec = attention_spec(call)
    if spec is None:
        if call.attrs.window_size is not None:  # the stock rule asserts on windows
            raise CompileError(f"sliding-window attention (window {call.attrs.window_size}) needs "
                               f"static shapes: {call.op.name} with q {call.args[0].ty}")
        if parse_causal_attr(call.attrs.causal_mask)[1] is not None:  # the stock rule has no cap
            raise CompileError(f"soft-capped attention needs static shapes: {call.op.name} with "
                               f"q {call.args[0].ty}")
        rule = stock._nn_attention_bias if len(call.args) > 3 else stock._nn_attention
        return rule(bb, call)
    gated = gpu_window_gate(spec.window) or gpu_value_dim_gate(spec.v_head_dim is not None)
    func = None if gated else attention_kernel(spec)
    if func is None:  # no kernel for this dtype / head dim (or window) on target
        return _decomposed(call, spec)
    gvar = bb.add_func(func, "attention")  # the report classifies kernels by this name
    return relax.call_tir(gvar, list(call.args), call.ty)


def gpu_window_gate(window: int | None) -> str | None:
    """Why a sliding window of ``window`` keys gets no attention kernel on the current target, or
    None. The CUDA window kernels (flash sm90a / sm80, split-KV decode, the CUDA-core fallback; GPU
    numerics checked on the H200 in session 8) are used unless ``Options(gpu_window_attention=False)``;
    the cpu kernel always."""
    if window is None or not _cuda_option_off("gpu_window_attention"):
        return None
    return "the CUDA sliding-window kernels are off (Options(gpu_window_attention=False))"


def gpu_value_dim_gate(narrower_values: bool) -> str | None:
    """Why values of their own width (multi-head latent attention) get no attention kernel on the
    current target, or None: on CUDA targets unless ``Options(gpu_mla_attention=True)`` (the
    kernels' GPU numerics have not run yet); the cpu kernel always."""
    if not narrower_values or not _cuda_option_off("gpu_mla_attention"):
        return None
    return ("the CUDA kernel for values of their own width is off until its GPU numerics have run "
            "(Options(gpu_mla_attention=True) turns it on)")


def _cuda_option_off(option: str) -> bool:
    """The current target is CUDA and the ``Options`` switch ``option`` (a gated kernel) is off."""
    target = tvm.target.Target.current(allow_none=True)
    return target is not None and target.kind.name == "cuda" and not getattr(current_options(), option)


def attention_kernel(spec: AttentionSpec) -> tvm.tirx.PrimFunc | None:
    """The kernel computing ``spec`` on the current target (none: the host CPU), or None where
    no kernel takes the spec."""
    target = tvm.target.Target.current() or tvm.target.Target("llvm")
    try:
        return attention_primfunc(spec, target)
    except (ValueError, NotImplementedError):
        return None


def _decomposed(call: relax.Call, spec) -> relax.Expr:
    """softmax(scale·Q·Kᵀ [soft-capped] + bias, causal) · V in plain Relax ops (fp32 scores), GQA
    by repeat.

    A row whose scores are all −inf gives 0, as the kernels do (contract in schedules/attention_spec.py).
    """
    q, k, v = (relax.op.permute_dims(a, [0, 2, 1, 3]) for a in call.args[:3])  # → (B, H, S, D)
    if spec.group > 1:
        k, v = (relax.op.repeat(a, spec.group, axis=1) for a in (k, v))
    s = relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2]), out_dtype="float32")
    s = relax.op.multiply(s, relax.const(spec.scale, "float32"))
    if spec.softcap is not None:
        cap = relax.const(spec.softcap, "float32")
        s = relax.op.multiply(relax.op.tanh(relax.op.divide(s, cap)), cap)
    if spec.bias_shape is not None:
        s = relax.op.add(s, relax.op.astype(call.args[3], "float32"))
    if spec.causal != "none":
        offset = 0 if spec.causal == "TopLeft" else spec.kv_len - spec.q_len
        visible = np.tril(np.ones((spec.q_len, spec.kv_len), bool), offset)
        if spec.window is not None:
            visible &= np.triu(np.ones_like(visible), offset - spec.window + 1)
        s = relax.op.where(relax.const(visible), s, relax.const(float("-inf"), "float32"))
    p = relax.op.nn.softmax(s, axis=-1)
    if spec.bias_shape is not None or spec.kv_len < spec.q_len:  # rows may see no key: 0, not NaN
        finite = relax.op.not_equal(s, relax.const(float("-inf"), "float32"))
        seen = relax.op.max(relax.op.astype(finite, "int8"), axis=-1, keepdims=True)
        p = relax.op.where(relax.op.astype(seen, "bool"), p, relax.const(0.0, "float32"))
    p = relax.op.astype(p, spec.dtype)
    out = relax.op.permute_dims(relax.op.matmul(p, v), [0, 2, 1, 3])
    return out if spec.result_dtype == spec.dtype else relax.op.astype(out, spec.result_dtype)


def _keep_attrs(call: relax.Call, _out_dtype) -> relax.Call:
    a = call.attrs
    bias = call.args[3] if len(call.args) > 3 else None
    return relax.op.nn.attention(call.args[0], call.args[1], call.args[2], bias, a.scale,
                                 a.causal_mask, a.window_size)


def register_mixed_precision_fix() -> None:
    """Make ToMixedPrecision keep attention's bias, scale and causal mask (0.27 drops them)."""
    for name in _OPS:
        tvm.ir.register_op_attr(name, "FInferMixedPrecision", _keep_attrs, level=11)
