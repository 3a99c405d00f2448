"""The standard ONNX ``Attention`` (ai.onnx, opsets 23–25).

TVM 0.27 dispatches every node by op type alone and sends the standard op to its
``com.microsoft`` ``Attention`` converter (packed QKV weight, ``num_heads``), which fails on it.
Here, with Q (B, Hq, Sq, D), K (B, Hkv, Skv, D), V (B, Hkv, Skv, Dv) (or 3-D (B, S, H·D) with the
``q_num_heads`` / ``kv_num_heads`` attributes)::

    K, V   = concat(past_key, K), concat(past_value, V)        on the sequence axis (present_*)
    S      = scale · Q·Kᵀ                                       (scale default 1/√D)
    S      = softcap · tanh(S / softcap)                        softcap > 0
    Y      = softmax(S + bias) · V                              a row with no visible key gives 0

GQA when Hkv < Hq (query head h reads KV head h // (Hq/Hkv), as ONNX repeats KV heads).
``bias`` sums what hides key j from query i, with ``p = i + off`` the query's absolute position
(``off`` = past length, or ``nonpad_kv_seqlen[b] − Sq`` with that input, else 0):

* ``attn_mask`` bool (True attends: 0 / −inf) or float (added), right-aligned to (B, Hq, Sq, Skv)
  and padded with −inf / False up to Skv;
* ``is_causal``: j ≤ p;  ``left_window_size`` L ≥ 0: j ≥ p − L;  ``right_window_size`` R ≥ 0: j ≤ p + R;
* ``nonpad_kv_seqlen`` (B,): j < nonpad_kv_seqlen[b].

Two lowerings:

* the plain forms → one ``R.nn.attention`` (BSNH; the flash / cpu kernels; a ``softcap`` is the
  kernels' own, :mod:`tvmfuse.kernels.attention.spec`): no ``qk_matmul_output``, softmax in
  fp32 / fp16 / bf16, Dv == D under GQA (the kernels need Dv == D; TVM's own lowering, used
  otherwise, has no GQA). A causal band (upper bound ``j ≤ p + U``
  meeting TopLeft (0) or BottomRight (Skv − Sq) alignment) is the call's ``causal_mask`` and a
  lower bound its ``window_size`` (when Dv == D); any other structure is a −inf bias built from the static
  shapes (a constant) or from ``nonpad_kv_seqlen`` (Relax ops at run time);
* otherwise (a ``qk_matmul_output`` output, ``softmax_precision`` DOUBLE): the formula above
  in Relax ops (:func:`_decomposed`): fp32 scores (fp64 for DOUBLE), the fully-masked-row guard
  decided on the bias as the ONNX reference does, ``qk_matmul_output`` per
  ``qk_matmul_output_mode`` (0 / 1: S after softcap, 2: S + bias, 3: the softmax), all
  (B, Hq, Sq, Skv).

``present_key`` / ``present_value`` are the concatenated K and V in (B, Hkv, Skv, ·).
What this does not handle (:func:`attention_refusals`) is reported, with the node and the
attribute or input, before conversion starts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...attrs import causal_attr
from ...relax_shapes import shape_expr, static_shape

_INPUTS = ["Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen"]
_KERNEL_SOFTMAX = (1, 10, 16)  # FLOAT, FLOAT16, BFLOAT16: the kernels' fp32 softmax is as fine
_DOUBLE = 11
_ATTRIBUTES = {"is_causal", "q_num_heads", "kv_num_heads", "scale", "softcap", "qk_matmul_output_mode",
               "softmax_precision", "left_window_size", "right_window_size", "tvm_custom"}


def attention_refusals(attrs: dict[str, Any], inputs: list[str], outputs: list[str]) -> list[str]:
    """What an ONNX ``Attention`` node asks for that :class:`Attention` does not do, one line each.

    ``attrs``: attribute values by name; ``inputs`` / ``outputs``: the node's names ("" = absent).
    """
    why = []
    given = {name for name, value in zip(_INPUTS, inputs) if value}
    if len(inputs) > len(_INPUTS):
        why.append(f"input #{len(_INPUTS)} (Attention has {len(_INPUTS)} inputs)")
    if len(given & {"past_key", "past_value"}) == 1:
        why.append("input past_key without past_value (or the reverse): both or neither")
    if "nonpad_kv_seqlen" in given and "past_key" in given:
        why.append("input nonpad_kv_seqlen with past_key (ONNX allows one KV cache form at a time)")
    if attrs.get("softmax_precision", 1) not in (*_KERNEL_SOFTMAX, _DOUBLE):
        why.append(f"attribute softmax_precision={attrs['softmax_precision']} (a float type expected)")
    if attrs.get("qk_matmul_output_mode", 0) not in (0, 1, 2, 3):
        why.append(f"attribute qk_matmul_output_mode={attrs['qk_matmul_output_mode']}")
    if attrs.get("softcap", 0.0) < 0:
        why.append(f"attribute softcap={attrs['softcap']} (must be >= 0)")
    for name in ("left_window_size", "right_window_size"):
        if attrs.get(name, -1) < -1:
            why.append(f"attribute {name}={attrs[name]} (must be -1 or >= 0)")
    for name in sorted(set(attrs) - _ATTRIBUTES):
        why.append(f"attribute {name}={attrs[name]}")
    return why


def _bhsd(x: relax.Expr, heads: int | None, what: str) -> relax.Expr:
    """(B, H, S, D) as is; (B, S, H·D) → (B, H, S, D) with ``heads`` from the attributes."""
    shape = static_shape(x)
    if shape is None or len(shape) not in (3, 4):
        raise ValueError(f"Attention: {what} must be a 3-D or 4-D tensor of static shape, got {x.ty}")
    if len(shape) == 4:
        return x
    if not heads or shape[2] % heads:
        raise ValueError(f"Attention: 3-D {what} {shape} needs a head count dividing {shape[2]} "
                         "(q_num_heads / kv_num_heads)")
    split = relax.op.reshape(x, shape_expr([shape[0], shape[1], heads, shape[2] // heads]))
    return relax.op.permute_dims(split, [0, 2, 1, 3])


def _bshd(bb: relax.BlockBuilder, x: relax.Expr, heads: int | None) -> relax.Expr:
    """(B, H, S, D) → (B, S, H, D) by a transpose; (B, S, H·D) → (B, S, H, D) by a reshape."""
    shape = static_shape(x)
    if len(shape) == 4:
        return bb.normalize(relax.op.permute_dims(x, [0, 2, 1, 3]))
    return bb.normalize(relax.op.reshape(x, shape_expr([*shape[:2], heads, shape[2] // heads])))


def _from_bshd(bb: relax.BlockBuilder, y: relax.Expr, ndim: int) -> relax.Expr:
    """The (B, Sq, Hq, Dv) result as Y: (B, Hq, Sq, Dv) for 4-D inputs, (B, Sq, Hq·Dv) for 3-D."""
    b, sq, hq, dv = static_shape(y)
    out = relax.op.permute_dims(y, [0, 2, 1, 3]) if ndim == 4 else \
        relax.op.reshape(y, shape_expr([b, sq, hq * dv]))
    return bb.normalize(out)


def _from_bhsd(bb: relax.BlockBuilder, y: relax.Expr, ndim: int) -> relax.Expr:
    """The (B, Hq, Sq, Dv) result as Y (see :func:`_from_bshd`)."""
    return y if ndim == 4 else _from_bshd(bb, bb.normalize(relax.op.permute_dims(y, [0, 2, 1, 3])), ndim)


def _mask_bias(bb: relax.BlockBuilder, mask: relax.Expr, dtype: str, skv: int) -> relax.Expr:
    """``attn_mask`` as an additive 4-D bias of ``dtype``, its last axis padded to ``skv``."""
    shape = static_shape(mask)
    if shape is None or not 1 <= len(shape) <= 4:
        raise ValueError(f"Attention: attn_mask must have a static shape of rank 1 to 4, got {mask.ty}")
    boolean = str(mask.ty.dtype) == "bool"
    if shape[-1] < skv:
        fill = relax.const(False if boolean else -math.inf, str(mask.ty.dtype))
        pad = relax.op.full(shape_expr([*shape[:-1], skv - shape[-1]]), fill, str(mask.ty.dtype))
        mask = bb.normalize(relax.op.concat([mask, pad], axis=-1))
    if boolean:
        mask = relax.op.where(mask, relax.const(0.0, dtype), relax.const(-math.inf, dtype))
    elif str(mask.ty.dtype) != dtype:
        mask = relax.op.astype(mask, dtype)
    if len(shape) < 4:
        mask = relax.op.reshape(mask, shape_expr([1] * (4 - len(shape)) + [*shape[:-1], skv]))
    return bb.normalize(mask)


class _Band:
    """The visible keys of query i: ``p − lower ≤ j ≤ p + upper`` with ``p = i + off`` (None: unbounded)."""

    def __init__(self, attr: dict[str, Any]):
        right = attr.get("right_window_size", -1)
        uppers = ([0] if attr.get("is_causal", 0) else []) + ([right] if right >= 0 else [])
        self.upper = min(uppers) if uppers else None
        left = attr.get("left_window_size", -1)
        self.lower = left if left >= 0 else None

    def __bool__(self) -> bool:
        return self.upper is not None or self.lower is not None

    def kernel_form(self, off: int, sq: int, skv: int) -> tuple[str, int | None] | None:
        """``(causal_mask, window_size)`` of ``R.nn.attention`` computing this band, or None."""
        if self.upper is None:
            return None
        for kind, shift in (("TopLeft", 0), ("BottomRight", skv - sq)):
            if off + self.upper == shift:
                return kind, None if self.lower is None else self.upper + self.lower + 1
        return None

    def visible(self, diff: relax.Expr) -> relax.Expr:
        """Bool ``lower ≥ diff ≥ −upper`` of ``diff = p − j`` (int64)."""
        conds = []
        if self.upper is not None:
            conds.append(relax.op.greater_equal(diff, relax.const(-self.upper, "int64")))
        if self.lower is not None:
            conds.append(relax.op.less_equal(diff, relax.const(self.lower, "int64")))
        return conds[0] if len(conds) == 1 else relax.op.logical_and(*conds)


def _visibility(bb, band: _Band, nonpad: relax.Expr | None, b: int, sq: int, skv: int, off: int,
                kernel_band: bool) -> relax.Expr | None:
    """Bool (B|1, 1, Sq|1, Skv) of the keys the band and ``nonpad_kv_seqlen`` leave visible, or
    None when nothing is hidden (or the band is left to the kernel: ``kernel_band``)."""
    i_minus_j = np.arange(sq).reshape(sq, 1) - np.arange(skv).reshape(1, skv)
    parts = []
    if nonpad is not None:
        seqlen = bb.normalize(relax.op.reshape(relax.op.astype(nonpad, "int64"), shape_expr([b, 1, 1, 1])))
        keys = relax.const(np.arange(skv, dtype="int64").reshape(1, 1, 1, skv), "int64")
        parts.append(relax.op.less(keys, seqlen))
        if band:  # p = i + nonpad[b] − Sq, per batch row
            diff = relax.op.add(relax.const(i_minus_j.reshape(1, 1, sq, skv) - sq, "int64"), seqlen)
            parts.append(band.visible(bb.normalize(diff)))
    elif band and not kernel_band:
        diff = relax.const((i_minus_j + off).reshape(1, 1, sq, skv), "int64")
        parts.append(band.visible(diff))
    if not parts:
        return None
    return bb.normalize(parts[0] if len(parts) == 1 else relax.op.logical_and(*parts))


def _add_visibility(bias: relax.Expr | None, visible: relax.Expr | None, dtype: str) -> relax.Expr | None:
    if visible is None:
        return bias
    hidden = relax.op.where(visible, relax.const(0.0, dtype), relax.const(-math.inf, dtype))
    return hidden if bias is None else relax.op.add(bias, hidden)


def _decomposed(bb, q, k, v, bias, attr: dict[str, Any], scale: float) -> tuple[relax.Expr, relax.Expr]:
    """``(Y, qk_matmul_output)`` in (B, Hq, Sq, Dv) and (B, Hq, Sq, Skv) from (B, H, S, ·) operands."""
    dtype = str(q.ty.dtype)
    hq, hkv = static_shape(q)[1], static_shape(k)[1]
    if hq != hkv:
        k, v = (relax.op.repeat(a, hq // hkv, axis=1) for a in (k, v))
    acc = "float64" if attr.get("softmax_precision") == _DOUBLE else "float32"
    s = relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2]), out_dtype="float32")
    s = relax.op.multiply(s, relax.const(scale, "float32"))
    cap = attr.get("softcap", 0.0)
    if cap > 0:
        s = relax.op.multiply(relax.op.tanh(relax.op.divide(s, relax.const(cap, "float32"))),
                              relax.const(cap, "float32"))
    s = bb.normalize(relax.op.astype(s, acc) if acc != "float32" else s)
    mode = attr.get("qk_matmul_output_mode", 0)
    qk = s
    if bias is not None:
        bias = bb.normalize(relax.op.astype(bias, acc) if str(bias.ty.dtype) != acc else bias)
        s = bb.normalize(relax.op.add(s, bias))
        if mode == 2:
            qk = s
    p = relax.op.nn.softmax(s, axis=-1)
    if bias is not None:  # a row whose bias hides every key gives 0 (decided on the bias, as ONNX)
        hidden = relax.op.equal(relax.op.max(bias, axis=-1, keepdims=True), relax.const(-math.inf, acc))
        p = relax.op.where(hidden, relax.const(0.0, acc), p)
    p = bb.normalize(p)
    if mode == 3:
        qk = p
    y = relax.op.matmul(relax.op.astype(p, dtype), v)
    return bb.normalize(y), bb.normalize(relax.op.astype(qk, dtype))


class Attention(stock.OnnxOpConverter):
    """The standard ONNX ``Attention`` (see the module docstring)."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        node = attr["tvm_custom"]["name"]
        q, k, v, mask, past_k, past_v, nonpad = (list(inputs) + [None] * 7)[:7]
        ndim = len(static_shape(q) or [])
        q4 = bb.normalize(_bhsd(q, attr.get("q_num_heads"), f"Q of node {node!r}"))
        k4 = bb.normalize(_bhsd(k, attr.get("kv_num_heads"), f"K of node {node!r}"))
        v4 = bb.normalize(_bhsd(v, attr.get("kv_num_heads"), f"V of node {node!r}"))
        off = 0
        if past_k is not None:
            off = static_shape(past_k)[2]
            k4 = bb.normalize(relax.op.concat([past_k, k4], axis=2))
            v4 = bb.normalize(relax.op.concat([past_v, v4], axis=2))
        (b, hq, sq, d), (_, hkv, skv, _) = static_shape(q4), static_shape(k4)
        if hq % hkv:
            raise ValueError(f"Attention node {node!r}: {hq} query heads are not a multiple of "
                             f"{hkv} key/value heads")
        dtype = str(q.ty.dtype)
        scale = attr.get("scale", 1.0 / math.sqrt(d))
        outputs = attr["tvm_custom"]["num_outputs"]
        dv = static_shape(v4)[3]
        decompose = (outputs > 3
                     or attr.get("softmax_precision", 1) not in _KERNEL_SOFTMAX
                     or (hq != hkv and dv != d))  # no kernel; TVM's own lowering has no GQA
        band = _Band(attr)
        kernel = None if decompose or nonpad is not None or not band else band.kernel_form(off, sq, skv)
        if kernel is not None and kernel[1] is not None and dv != d:
            kernel = None  # TVM's window attention needs Dv == D: the band becomes a bias
        bias_dtype = dtype if not decompose else "float32"
        bias = None if mask is None else _mask_bias(bb, mask, bias_dtype, skv)
        visible = _visibility(bb, band, nonpad, b, sq, skv, off, kernel_band=kernel is not None)
        bias = _add_visibility(bias, visible, bias_dtype)
        bias = None if bias is None else bb.normalize(bias)
        if decompose:
            y, qk = _decomposed(bb, q4, k4, v4, bias, attr, scale)
            results = [_from_bhsd(bb, y, ndim), k4, v4, qk]
        else:
            causal, window = kernel or (None, None)
            kv = (k, v) if past_k is None else (k4, v4)  # the graph's, or the concatenated (BHSD)
            heads = (attr.get("q_num_heads"), attr.get("kv_num_heads"), attr.get("kv_num_heads"))
            operands = [_bshd(bb, x, h) for x, h in zip((q, *kv), heads)]
            cap = attr.get("softcap", 0.0)
            y = bb.normalize(relax.op.nn.attention(
                *operands, bias, scale=scale, window_size=window,
                causal_mask=causal_attr(causal or "none", cap if cap > 0 else None)))
            results = [_from_bshd(bb, y, ndim), k4, v4]
        return results[0] if outputs == 1 else relax.Tuple(results[:max(outputs, 3)])
