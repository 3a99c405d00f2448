"""Legalisations that replace broken ones in TVM 0.27, passed to ``LegalizeOps``.

``relax.full`` / ``relax.full_like`` with an inf or NaN fill (``torch.full(..., -inf)`` in every
causal mask) crash in 0.27: the stock rule hands ``topi.full`` a ``PrimType`` where it expects a
dtype string (``"float" in dtype`` → "argument of type 'PrimType' is not iterable").
"""

from __future__ import annotations

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


def legalize_overrides() -> dict:
    """``{op name: legalize function}`` for ``relax.transform.LegalizeOps``."""
    return {"relax.full": _full(False), "relax.full_like": _full(True),
            "relax.nn.attention": legalize_attention, "relax.nn.attention_bias": legalize_attention}
