"""ONNX ``LinearAttention`` (opset 27): the recurrent state update of linear-attention layers
(RetNet / GLA / DeltaNet / Gated DeltaNet), unrolled over the static sequence length T.

``query`` (B, T, Hq·dk), ``key`` (B, T, Hkv·dk), ``value`` (B, T, Hkv·dv), ``past_state``
(B, Hkv, dk, dv) (zeros without), ``decay`` (B, T, Hkv or Hkv·dk), ``beta`` (B, T, Hkv or 1).
In fp32, for t = 0 … T − 1 and each KV head (query head h reads KV head h // (Hq/Hkv))::

    S  = S · exp(decay_t)                        update_rule gated, gated_delta (per dk row)
    v' = beta_t · (v_t − Sᵀ k_t)                 update_rule delta, gated_delta (else v' = v_t)
    S  = S + k_t ⊗ v'
    o_t = scale · q_tᵀ S                         (scale default 1/√dk)

``output`` (B, T, Hq·dv) in the query dtype, ``present_state`` = S in ``past_state``'s dtype (the
query's without one). Each step is a handful of batched matmuls and elementwise ops; sequences
longer than :data:`MAX_STEPS` are refused (the unrolled graph would be that many times larger).
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import shape_expr, static_shape
from .refusals import refuse

MAX_STEPS = 256
_F32 = "float32"
_RULES = {"linear": (False, False), "gated": (True, False), "delta": (False, True),
          "gated_delta": (True, True)}  # rule → (gating, delta correction)


def _heads(bb, x: relax.Expr, heads: int, what: str) -> relax.Expr:
    """(B, T, H·d) → (B, H, T, d) in fp32."""
    b, t, hd = static_shape(x)
    if hd % heads:
        raise ValueError(f"LinearAttention: {what} {[b, t, hd]} last dim is not a multiple of {heads} heads")
    y = relax.op.permute_dims(relax.op.reshape(x, shape_expr([b, t, heads, hd // heads])), [0, 2, 1, 3])
    return bb.normalize(relax.op.astype(y, _F32) if str(x.ty.dtype) != _F32 else y)


def _step(x: relax.Expr, t: int) -> relax.Expr:
    """Position t of a (B, H, T, d) tensor: (B, H, 1, d)."""
    return relax.op.strided_slice(x, [2], [t], [t + 1])


def _column(x: relax.Expr) -> relax.Expr:
    """(B, H, 1, d) → (B, H, d, 1)."""
    return relax.op.permute_dims(x, [0, 1, 3, 2])


class LinearAttention(stock.OnnxOpConverter):
    """``LinearAttention`` → the recurrence above, one step per position (module docstring)."""

    @classmethod
    def _impl_v27(cls, bb, inputs, attr, params):
        q, k, v = inputs[:3]
        past, decay, beta = (list(inputs[3:]) + [None] * 3)[:3]
        rule = attr.get("update_rule", b"gated_delta")
        rule = rule.decode() if isinstance(rule, bytes) else rule
        if rule not in _RULES:
            refuse(attr, f"LinearAttention attribute update_rule={rule!r} (linear, gated, delta or "
                         "gated_delta)")
        gating, delta = _RULES[rule]
        if gating != (decay is not None) or delta != (beta is not None):
            need = f"decay {'given' if gating else 'absent'}, beta {'given' if delta else 'absent'}"
            raise ValueError(f"LinearAttention: update_rule {rule!r} needs {need}")
        hq, hkv = attr.get("q_num_heads"), attr.get("kv_num_heads")
        if not hq or not hkv or hq % hkv:
            raise ValueError(f"LinearAttention: q_num_heads {hq} must be a multiple of kv_num_heads {hkv}")
        if any(static_shape(x) is None or len(static_shape(x)) != 3 for x in (q, k, v)):
            raise ValueError("LinearAttention: query, key and value must be 3-D of static shape")
        b, steps, _ = static_shape(q)
        if steps > MAX_STEPS:
            refuse(attr, f"LinearAttention over {steps} positions (tvmfuse unrolls the recurrence; at "
                         f"most {MAX_STEPS})")
        q4, k4, v4 = _heads(bb, q, hq, "query"), _heads(bb, k, hkv, "key"), _heads(bb, v, hkv, "value")
        dk, dv, group = static_shape(q4)[3], static_shape(v4)[3], hq // hkv
        if decay is not None:
            last = static_shape(decay)[-1]
            if last not in (hkv, hkv * dk):
                raise ValueError(f"LinearAttention: decay's last dim {last} is not {hkv} or {hkv * dk}")
            decay = _heads(bb, decay, hkv, "decay")  # (B, Hkv, T, 1|dk)
        if beta is not None:
            last = static_shape(beta)[-1]
            if last not in (hkv, 1):
                raise ValueError(f"LinearAttention: beta's last dim {last} is not {hkv} or 1")
            beta = _heads(bb, beta, last, "beta")  # (B, Hkv|1, T, 1)
        scale = attr.get("scale", 0.0) or 1.0 / math.sqrt(dk)
        state_dtype = str((past if past is not None else q).ty.dtype)
        if past is None:
            state = relax.op.zeros(shape_expr([b, hkv, dk, dv]), _F32)
        else:
            state = relax.op.astype(past, _F32) if state_dtype != _F32 else past
        state = bb.normalize(state)
        outs = []
        for t in range(steps):
            k_t, v_t = bb.normalize(_step(k4, t)), _step(v4, t)
            if gating:  # (B, Hkv, 1, dk|1) → a factor per state row
                state = relax.op.multiply(state, relax.op.exp(_column(_step(decay, t))))
            if delta:
                retrieved = relax.op.matmul(k_t, state)  # (B, Hkv, 1, dv)
                v_t = relax.op.multiply(_step(beta, t), relax.op.subtract(v_t, retrieved))
            state = bb.normalize(relax.op.add(state, relax.op.matmul(_column(k_t), v_t)))
            q_t = relax.op.reshape(_step(q4, t), shape_expr([b, hkv, group, dk]))  # GQA: heads of a group
            outs.append(bb.normalize(relax.op.matmul(q_t, state)))  # (B, Hkv, group, dv)
        o = relax.op.multiply(relax.op.stack(outs, axis=1), relax.const(scale, _F32))  # (B, T, Hkv, g, dv)
        y = relax.op.astype(relax.op.reshape(o, shape_expr([b, steps, hq * dv])), str(q.ty.dtype))
        present = relax.op.astype(state, state_dtype) if state_dtype != _F32 else state
        return relax.Tuple([bb.normalize(y), bb.normalize(present)])
