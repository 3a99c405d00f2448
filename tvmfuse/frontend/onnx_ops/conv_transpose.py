"""ONNX ``ConvTranspose`` with ``output_shape`` (0.27 ignores it and returns the natural size).

For each spatial axis, with F = s·(X − 1) + out_pad + (k − 1)·d + 1 (the size without pads)::

    total = F − output_shape
    begin = total // 2 (SAME_UPPER) | total − total // 2 (SAME_LOWER, NOTSET: total ∈ {0, −1})
    → TVM's converter with pads (begin, max(end, 0)), output_padding + max(−end, 0)

where end = total − begin. Only the forms where onnxruntime and the ONNX reference agree are
accepted (``SAME_*`` with total ≥ 0; ``NOTSET`` / ``SAME_LOWER`` with total = −1, the extra
row at the end; ``NOTSET`` with total 0; no explicit ``pads``); the others are refused.
"""

from __future__ import annotations

from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape
from ._common import refuse


def _pads(total: int, auto_pad: str) -> int | None:
    """``begin`` of one axis, or None where the runtimes disagree."""
    if auto_pad in ("SAME_UPPER", "SAME_LOWER") and total >= 0:
        return total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
    if auto_pad in ("NOTSET", "SAME_LOWER") and total in (0, -1):
        return 0
    return None


class ConvTranspose(stock.ConvTranspose):
    """``ConvTranspose``; ``output_shape`` becomes pads and output padding."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if "output_shape" not in attr:
            return super()._impl_v1(bb, inputs, attr, params)
        attr = dict(attr)
        target = list(attr.pop("output_shape"))
        auto_pad = attr.pop("auto_pad", b"NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
        x_shape, w_shape = static_shape(inputs[0]), static_shape(inputs[1])
        if x_shape is None or w_shape is None or "pads" in attr:
            raise refuse(attr, "ConvTranspose", "attribute output_shape with explicit pads or dynamic shapes")
        dims = len(x_shape) - 2
        target = target[-dims:]
        strides = list(attr.get("strides", [1] * dims))
        dilations = list(attr.get("dilations", [1] * dims))
        out_pad = list(attr.get("output_padding", [0] * dims))
        kernel = list(attr.get("kernel_shape", w_shape[2:]))
        begins, ends = [], []
        for i in range(dims):
            natural = strides[i] * (x_shape[i + 2] - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1
            total = natural - target[i]
            begin = _pads(total, auto_pad)
            if begin is None:
                raise refuse(attr, "ConvTranspose", f"attribute output_shape={target} with auto_pad="
                             f"{auto_pad} (total padding {total} along axis {i})")
            begins.append(begin)
            ends.append(total - begin)
        attr["pads"] = begins + [max(e, 0) for e in ends]
        attr["output_padding"] = [p + max(-e, 0) for p, e in zip(out_pad, ends, strict=True)]
        if any(p >= max(s, d) for p, s, d in zip(attr["output_padding"], strides, dilations, strict=True)):
            raise refuse(attr, "ConvTranspose", f"attribute output_shape={target} (an output padding "
                         "beyond the stride)")
        return super()._impl_v1(bb, inputs, attr, params)
