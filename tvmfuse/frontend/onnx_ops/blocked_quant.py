"""ONNX ``QuantizeLinear`` / ``DequantizeLinear`` (opset 21+) with ``block_size`` (blocked
quantization; 0.27 refuses it). ``scale`` / ``zero_point`` have x's shape but
``ceil(D / block_size)`` along ``axis``: each entry covers ``block_size`` consecutive elements::

    s = repeat(scale, block_size, axis)[…, :D, …]           (zero_point likewise)
    quantize:    y = clip(round_half_even(x / s) + zp, lo, hi)       8- / 16-bit integer outputs
    dequantize:  y = (float32(x) − float32(zp)) · s                  in the scale's dtype

(the ONNX reference's arithmetic). Other forms keep TVM's converters.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape
from ._common import dtype_of, refuse

_RANGES = {"uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535), "int16": (-32768, 32767)}


def _expanded(bb: relax.BlockBuilder, value: relax.Expr, block: int, axis: int, length: int) -> relax.Expr:
    """``value`` repeated ``block`` times along ``axis`` and cut to ``length``."""
    wide = relax.op.repeat(value, block, axis)
    return bb.normalize(relax.op.strided_slice(wide, [axis], [0], [length]))


def _operands(bb, inputs, attr, op: str) -> tuple:
    """``(x, scale, zero_point | None, axis)`` with scale / zero point expanded to x's shape."""
    x, scale = inputs[0], inputs[1]
    zp = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    shape = static_shape(x)
    if shape is None:
        raise refuse(attr, op, "blocked quantization of an input of dynamic shape")
    axis = attr.get("axis", 1) % len(shape)
    block = int(attr["block_size"])
    want = list(shape)
    want[axis] = -(-shape[axis] // block)
    for name, value in (("scale", scale), ("zero_point", zp)):
        if value is not None and static_shape(value) != want:
            raise refuse(attr, op, f"{name} of shape {static_shape(value)} for blocks {want}")
    expand = [_expanded(bb, v, block, axis, shape[axis]) if v is not None else None for v in (scale, zp)]
    return x, expand[0], expand[1], axis


class _Blocked:
    """``block_size`` set: the subclass's ``_blocked``; otherwise TVM's converter (next in the MRO)."""

    @classmethod
    def _impl_v21(cls, bb, inputs, attr, params):
        if not attr.get("block_size", 0):
            return super()._impl_v21(bb, inputs, attr, params)
        return cls._blocked(bb, inputs, attr)

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        if not attr.get("block_size", 0):
            return super()._impl_v23(bb, inputs, attr, params)
        cls._check_v23(attr)
        return cls._blocked(bb, inputs, attr)

    @classmethod
    def _check_v23(cls, attr) -> None:
        """Refuse the opset-23 attributes ``_blocked`` does not handle (none by default)."""


class QuantizeLinear(_Blocked, stock.QuantizeLinear):
    """``QuantizeLinear``, blocked to integer types here, the rest by TVM's converter."""

    @classmethod
    def _check_v23(cls, attr) -> None:
        if attr.get("precision", 0):
            raise refuse(attr, "QuantizeLinear", f"attribute precision={attr['precision']}")

    @classmethod
    def _blocked(cls, bb, inputs, attr):
        x, scale, zp, _ = _operands(bb, inputs, attr, "QuantizeLinear")
        output = attr.get("output_dtype", 0)
        dtype = stock.get_type(output) if output else dtype_of(zp) if zp is not None else "uint8"
        if dtype not in _RANGES or (zp is not None and dtype_of(zp) != dtype):
            raise refuse(attr, "QuantizeLinear", f"blocked quantization to {dtype}")
        # x / s in x's dtype (as the reference), the integers summed in float32 (exact)
        y = relax.op.astype(relax.op.round(relax.op.divide(x, relax.op.astype(scale, dtype_of(x)))),
                            "float32")
        if zp is not None:
            y = relax.op.add(y, relax.op.astype(zp, "float32"))
        lo, hi = _RANGES[dtype]
        return relax.op.astype(relax.op.clip(y, lo, hi), dtype)


class DequantizeLinear(_Blocked, stock.DequantizeLinear):
    """``DequantizeLinear``, blocked here, the rest by TVM's converter."""

    @classmethod
    def _blocked(cls, bb, inputs, attr):
        x, scale, zp, _ = _operands(bb, inputs, attr, "DequantizeLinear")
        if dtype_of(x) not in _RANGES:
            raise refuse(attr, "DequantizeLinear", f"blocked dequantization of {dtype_of(x)}")
        output = attr.get("output_dtype", 0)
        dtype = stock.get_type(output) if output else dtype_of(scale)
        dx = relax.op.astype(x, "float32")
        if zp is not None:
            dx = relax.op.subtract(dx, relax.op.astype(zp, "float32"))
        y = relax.op.multiply(dx, relax.op.astype(scale, "float32"))
        return y if dtype == "float32" else relax.op.astype(y, dtype)

