"""ONNX ``NonMaxSuppression`` (opset 10+): greedy per-class NMS, a data-dependent output count.

Per batch ``b`` and class ``c`` (boxes (B, N, 4), scores (B, C, N))::

    candidates = {j : scores[b, c, j] > score_threshold}      (every j without the input)
    repeat while candidates and |selected| < max_output_boxes_per_class:
        j = argmax score over candidates (ties: the lowest j); drop j from candidates
        keep j unless IoU(box j, box s) > iou_threshold for some selected s
    selected_indices = [(b, c, j) for each kept j, in order]   → (num_selected, 3) int64

IoU as the ONNX reference computes it: corners ``[y1, x1, y2, x2]`` in either order
(``center_point_box=0``) or ``[xc, yc, w, h]`` (1); an empty intersection, a non-positive area
or union suppresses nothing. Absent inputs: max 0 (no output), IoU threshold 0.

One sequential kernel (``te.extern``) writes the selections into a (B·C·N, 3) buffer and their
count; the count becomes a symbolic dim bound at run time and the output is the buffer's first
``count`` rows. The thresholds are runtime tensors like the boxes.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ...relax_shapes import static_shape
from ._common import refuse
from .runtime_values import axis_window, symbolic_dims


def _extent(box, center: bool) -> tuple:
    """``(x_min, x_max, y_min, y_max)`` of one box (a 4-element accessor)."""
    if center:
        half_w, half_h = box(2) / 2, box(3) / 2
        return box(0) - half_w, box(0) + half_w, box(1) - half_h, box(1) + half_h
    return (tirx.min(box(1), box(3)), tirx.max(box(1), box(3)),
            tirx.min(box(0), box(2)), tirx.max(box(0), box(2)))


def _suppresses(box_a, box_b, center: bool, threshold, dtype: str) -> tirx.PrimExpr:
    """IoU(a, b) > threshold, with the reference's guards (a bool PrimExpr)."""
    ax0, ax1, ay0, ay1 = _extent(box_a, center)
    bx0, bx1, by0, by1 = _extent(box_b, center)
    ix0, ix1 = tirx.max(ax0, bx0), tirx.min(ax1, bx1)
    iy0, iy1 = tirx.max(ay0, by0), tirx.min(ay1, by1)
    inter = (ix1 - ix0) * (iy1 - iy0)
    area_a, area_b = (ax1 - ax0) * (ay1 - ay0), (bx1 - bx0) * (by1 - by0)
    union = area_a + area_b - inter
    zero = tirx.const(0, dtype)
    return tirx.all(ix1 > ix0, iy1 > iy0, inter > zero, area_a > zero, area_b > zero,
                    union > zero, inter / union > threshold)


def _nms_ir(boxes, scores, limits, out, count, center: bool, filtered: bool):
    """The sequential selection (see the module docstring); ``limits`` = (max, iou, score)."""
    n_batch, n_class, n_box = (int(d) for d in scores.shape)
    dtype = str(boxes.dtype)
    with IRBuilder() as ib:
        boxes, scores, out, count = (T.buffer_proxy(b) for b in (boxes, scores, out, count))
        max_out, iou, score_min = (T.buffer_proxy(b) for b in limits)
        with T.serial(0, 1):  # the scratch buffers below need an enclosing frame
            done = T.buffer_proxy(T.decl_buffer([n_box], "int8", scope="local"))
            state = T.buffer_proxy(T.decl_buffer([3], "int64", scope="local"))  # total, kept, best
            keep = T.buffer_proxy(T.decl_buffer([1], "int8", scope="local"))
            state[0] = tirx.const(0, "int64")
            with T.serial(0, n_batch) as b, T.serial(0, n_class) as c:
                with T.serial(0, n_box) as j:
                    passes = scores[b, c, j] > score_min[0] if filtered else tirx.const(True)
                    done[j] = tirx.Select(passes, tirx.const(0, "int8"), tirx.const(1, "int8"))
                state[1] = tirx.const(0, "int64")
                with T.serial(0, n_box):
                    with T.If(state[1] < max_out[0]):
                        with T.Then():
                            state[2] = tirx.const(-1, "int64")
                            with T.serial(0, n_box) as j:
                                best = state[2].astype("int32")
                                better = tirx.any(state[2] < 0, scores[b, c, j] > scores[b, c, best])
                                with T.If(tirx.all(done[j] == 0, better)):
                                    with T.Then():
                                        state[2] = j.astype("int64")
                            with T.If(state[2] >= 0):
                                with T.Then():
                                    pick = state[2].astype("int32")
                                    done[pick] = tirx.const(1, "int8")
                                    keep[0] = tirx.const(1, "int8")
                                    with T.serial(0, n_box) as k:
                                        with T.If(k < state[1]):
                                            with T.Then():
                                                other = out[state[0] - state[1] + k, 2].astype("int32")
                                                hit = _suppresses(lambda q: boxes[b, pick, q],
                                                                  lambda q: boxes[b, other, q],
                                                                  center, iou[0], dtype)
                                                with T.If(hit):
                                                    with T.Then():
                                                        keep[0] = tirx.const(0, "int8")
                                    with T.If(keep[0] == 1):
                                        with T.Then():
                                            row = state[0]
                                            out[row, 0] = b.astype("int64")
                                            out[row, 1] = c.astype("int64")
                                            out[row, 2] = state[2]
                                            state[0] = row + 1
                                            state[1] = state[1] + 1
            count[0] = state[0]
    return ib.get()


def _scalar(bb: relax.BlockBuilder, value, dtype: str, default) -> relax.Expr:
    """An optional scalar input as a (1,) tensor of ``dtype`` (``default`` when absent)."""
    if value is None:
        return relax.const(np.array([default], dtype), dtype)
    value = bb.normalize(relax.op.reshape(value, [1]))
    return bb.normalize(value if str(value.ty.dtype) == dtype else relax.op.astype(value, dtype))


class NonMaxSuppression(stock.OnnxOpConverter):
    """``NonMaxSuppression`` with static box / score shapes; thresholds may be runtime tensors."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        inputs = list(inputs) + [None] * (5 - len(inputs))
        boxes, scores = inputs[0], inputs[1]
        box_shape, score_shape = static_shape(boxes), static_shape(scores)
        center = attr.get("center_point_box", 0)
        if center not in (0, 1):
            raise refuse(attr, "NonMaxSuppression", f"attribute center_point_box={center}")
        if not box_shape or not score_shape:
            raise refuse(attr, "NonMaxSuppression", "boxes / scores of dynamic shape")
        dtype = str(boxes.ty.dtype)
        if dtype != str(scores.ty.dtype) or not dtype.startswith("float"):
            raise refuse(attr, "NonMaxSuppression", f"boxes / scores of dtype {dtype} / {scores.ty.dtype}")
        n_batch, n_class, n_box = score_shape
        if tuple(box_shape) != (n_batch, n_box, 4):
            raise refuse(attr, "NonMaxSuppression", f"boxes {box_shape} for scores {score_shape}")
        filtered = inputs[4] is not None
        limits = [_scalar(bb, inputs[2], "int64", 0), _scalar(bb, inputs[3], dtype, 0.0),
                  _scalar(bb, inputs[4], dtype, 0.0)]
        rows = max(n_batch * n_class * n_box, 1)

        def kernel(boxes_t: te.Tensor, scores_t: te.Tensor, *limit_t: te.Tensor) -> list:
            return te.extern([(rows, 3), (1,)], [boxes_t, scores_t, *limit_t],
                             lambda ins, outs: _nms_ir(ins[0], ins[1], ins[2:], outs[0], outs[1],
                                                       center == 1, filtered),
                             dtype=["int64", "int64"], name="non_max_suppression")

        found = bb.emit_te(kernel, boxes, scores, *limits)
        (selected,) = symbolic_dims(bb, relax.TupleGetItem(found, 1), 1, "nms")
        return axis_window(bb, bb.normalize(relax.TupleGetItem(found, 0)), 0,
                           tirx.IntImm("int64", 0), selected)

