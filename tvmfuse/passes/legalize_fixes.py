"""Legalisations that replace broken ones in TVM 0.27, passed to ``LegalizeOps``.

``relax.full`` / ``relax.full_like`` with an inf or NaN fill (``torch.full(..., -inf)`` in every
causal mask) crash in 0.27: the stock rule hands ``topi.full`` a ``PrimType`` where it expects a
dtype string (``"float" in dtype`` → "argument of type 'PrimType' is not iterable").

``relax.nn.softmax`` on fp16/bf16: the stock rule does max, exp and the row sum in half precision
(an fp16 running sum over 4096 terms loses ~3 digits, and TVM's half math converts per op). Ours
casts the row to fp32 in registers, so the kernel reads and writes half but sums in fp32.
"""

from __future__ import annotations

import tvm
from tvm import relax, topi
from tvm.relax.transform.legalize_ops.common import _try_convert_to_scalar_const

from .attention_lower import legalize_attention, register_mixed_precision_fix

register_mixed_precision_fix()  # before any ToMixedPrecision run: 0.27 drops attention's attrs


def _full(is_like: bool):
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        fill = _try_convert_to_scalar_const(call.args[1], python_native=True)
        shape = call.args[0].ty.shape if is_like else call.args[0]
        if not isinstance(shape, relax.ShapeExpr):
            raise NotImplementedError(f"full with a non-static shape {shape} is not supported")
        return bb.call_te(topi.full, shape.values, str(call.ty.dtype), fill,
                          primfunc_name_hint="full")

    return legalize


def _softmax(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """softmax(x) = exp(x − max x) / Σ exp(x − max x), computed in fp32 for half inputs."""
    dtype = str(call.args[0].ty.dtype)
    if dtype not in ("float16", "bfloat16"):
        return tvm.ir.Op.get("relax.nn.softmax").get_attr("FLegalize")(bb, call)
    axis = int(call.attrs.axis)
    return bb.call_te(lambda x: topi.cast(topi.nn.softmax(topi.cast(x, "float32"), axis), dtype),
                      call.args[0], primfunc_name_hint="softmax")


def legalize_overrides() -> dict:
    """``{op name: legalize function}`` for ``relax.transform.LegalizeOps``."""
    return {"relax.full": _full(False), "relax.full_like": _full(True), "relax.nn.softmax": _softmax,
            "relax.nn.attention": legalize_attention, "relax.nn.attention_bias": legalize_attention}
