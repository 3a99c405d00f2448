"""ONNX ``RoiAlign`` (opsets 10, 16), both modes, as the ONNX reference / onnxruntime compute it.

0.27's converter shifts the rois by −0.5 before ``spatial_scale`` (half_pixel: wrong unless the
scale is 1) and its ``max`` mode takes the maximum of bilinear samples, where ONNX takes the
maximum of the four weighted corners of each sample. Per roi n (batch ``batch_indices[n]``),
channel c, output bin (ph, pw)::

    start = roi[:2]·scale − o, size = roi[2:] − roi[:2] scaled   (o = 0.5 half_pixel, else 0 and
                                                                  size ≥ 1)
    bin = size / (out_h, out_w);  grid g = sampling_ratio, or ceil(size / out) when 0
    sample (iy, ix): y = start_h + ph·bin_h + (iy + ½)·bin_h / g_h   (x likewise)
        outside [−1, H] × [−1, W]: every weight 0; else y ← max(y, 0), y_low = ⌊y⌋ (clamped to H−1,
        where y ← y_low), ly = y − y_low; w1..w4 = (1−ly)(1−lx), (1−ly)lx, ly(1−lx), ly·lx
    avg: Y = Σ_samples Σ_k w_k·v_k / max(g_h·g_w, 1)
    max: Y = max_samples max_k w_k·v_k   (0 for an empty grid)

One TE kernel; the adaptive grid is a reduction whose extent is read from the rois.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape
from ._common import refuse


def _text(value, default: str) -> str:
    value = default if value is None else value
    return value.decode() if isinstance(value, bytes) else str(value)


def _roi_align(data: te.Tensor, rois: te.Tensor, batch: te.Tensor, out_h: int, out_w: int,
               ratio: int, scale: float, half_pixel: bool, max_mode: bool) -> te.Tensor:
    """(R, C, out_h, out_w) of the module docstring."""
    _, channels, height, width = (int(d) for d in data.shape)
    dtype = data.dtype

    def const(v):
        return tirx.const(v, dtype)

    def geometry(n):
        """(start_h, start_w, bin_h, bin_w, grid_h, grid_w) of roi ``n``."""
        shift = const(0.5 if half_pixel else 0.0)
        start_w, start_h = rois[n, 0] * const(scale) - shift, rois[n, 1] * const(scale) - shift
        size_w = rois[n, 2] * const(scale) - shift - start_w
        size_h = rois[n, 3] * const(scale) - shift - start_h
        if not half_pixel:
            size_w, size_h = tirx.max(size_w, const(1.0)), tirx.max(size_h, const(1.0))
        if ratio > 0:
            grid_h = grid_w = tirx.const(ratio, "int32")
        else:
            grid_h = tirx.ceil(size_h / const(out_h)).astype("int32")
            grid_w = tirx.ceil(size_w / const(out_w)).astype("int32")
        return start_h, start_w, size_h / const(out_h), size_w / const(out_w), grid_h, grid_w

    def corners(p, size):
        p = tirx.max(p, const(0.0))
        low = tirx.floor(p).astype("int32")
        last = low >= size - 1
        low = tirx.Select(last, tirx.const(size - 1, "int32"), low)
        high = tirx.Select(last, low, low + 1)
        return low, high, tirx.Select(last, low.astype(dtype), p) - low.astype(dtype)

    def sample(start, index, size, step, grid):
        offset = (step.astype(dtype) + const(0.5)) * size / grid.astype(dtype)
        return start + index.astype(dtype) * size + offset

    def reduced(n, c, ph, pw):
        start_h, start_w, bin_h, bin_w, grid_h, grid_w = geometry(n)
        iy, ix = te.reduce_axis((0, grid_h), "iy"), te.reduce_axis((0, grid_w), "ix")
        y, x = sample(start_h, ph, bin_h, iy, grid_h), sample(start_w, pw, bin_w, ix, grid_w)
        outside = tirx.any(y < const(-1.0), y > const(height), x < const(-1.0), x > const(width))
        y_low, y_high, ly = corners(y, height)
        x_low, x_high, lx = corners(x, width)
        b = batch[n].astype("int32")
        one, zero = const(1.0), const(0.0)
        terms = [(one - ly) * (one - lx) * data[b, c, y_low, x_low],
                 (one - ly) * lx * data[b, c, y_low, x_high],
                 ly * (one - lx) * data[b, c, y_high, x_low],
                 ly * lx * data[b, c, y_high, x_high]]
        if max_mode:
            best = tirx.max(tirx.max(terms[0], terms[1]), tirx.max(terms[2], terms[3]))
            return te.max(tirx.Select(outside, zero, best), axis=[iy, ix])
        return te.sum(tirx.Select(outside, zero, (terms[0] + terms[1]) + (terms[2] + terms[3])),
                      axis=[iy, ix])

    shape = (rois.shape[0], channels, out_h, out_w)
    total = te.compute(shape, reduced, name="roi_align_reduce")

    def finished(n, c, ph, pw):
        grid_h, grid_w = geometry(n)[4:]
        count = grid_h * grid_w
        if max_mode:
            return tirx.Select(count > 0, total[n, c, ph, pw], const(0.0))
        return total[n, c, ph, pw] / tirx.max(count, 1).astype(dtype)

    return te.compute(shape, finished, name="roi_align")


class RoiAlign(stock.RoiAlign):
    """``RoiAlign`` (see the module docstring)."""

    @classmethod
    def _impl(cls, bb, inputs, attr, params, default_coordinate_transformation_mode):
        data, rois, batch = inputs[:3]
        mode = _text(attr.get("mode"), "avg")
        transform = _text(attr.get("coordinate_transformation_mode"),
                          _text(default_coordinate_transformation_mode, ""))
        shape = static_shape(data)
        known = mode in ("avg", "max") and transform in ("half_pixel", "output_half_pixel")
        if not known or shape is None or len(shape) != 4 or str(data.ty.dtype) not in ("float32", "float64"):
            raise refuse(attr, "RoiAlign", f"mode={mode} / coordinate_transformation_mode="
                         f"{transform} / input {data.ty}")
        return bb.emit_te(_roi_align, data, rois, batch, attr.get("output_height", 1),
                          attr.get("output_width", 1), attr.get("sampling_ratio", 0),
                          float(attr.get("spatial_scale", 1.0)), transform == "half_pixel", mode == "max")
