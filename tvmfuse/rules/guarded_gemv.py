"""dlight's GEMV rule, except for reductions of at most ``TINY`` elements.

dlight's GEMV schedules a reduction in two stages (per-thread partial sums in local memory, then
a cross-thread sum). On a grouped ``conv1d`` with a batch axis (ONNX ``CausalConvWithState``'s
decode step: output (2, 4, 1), reduction over 1 × 4) the two stages map the fused (batch,
channel) index to ``threadIdx.y`` in different orders, so the second stage read partial sums that
other threads held in their registers: 0.69 relative error on the H200. A reduction this short
gains nothing from splitting across threads; it gets dlight's Fallback instead (one thread per
output, the sum serial), which has no second stage to disagree with the first.

A function without a reduction is no GEMV: declined before dlight's analysis, which asserts on
a write region whose index is data dependent (the decode cache append's ``if_then_else`` row).
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from ..errors import TVM_ERRORS

TINY = 64  # elements summed per output at or below which the serial schedule is used


def reduction_length(func: tirx.PrimFunc) -> int | None:
    """Elements summed per output by the reduction blocks of ``func`` (the largest static product
    of their reduce extents); None when there is no reduction or an extent is symbolic."""
    sch = s_tir.Schedule(func)
    lengths = []
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        extents = [iv.dom.extent for iv in sch.get(block).iter_vars
                   if iv.iter_type == tirx.IterVar.CommReduce]
        if not extents:
            continue
        if not all(isinstance(e, tirx.IntImm) for e in extents):
            return None
        lengths.append(math.prod(int(e) for e in extents))
    return max(lengths, default=None)


def _has_reduction(func: tirx.PrimFunc) -> bool | None:
    """Whether a block under the root of ``func`` has a reduction iterator; None when ``func`` has
    no root block to look under (dlight's own analysis then decides)."""
    try:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except TVM_ERRORS:
        return None
    return any(iv.iter_type == tirx.IterVar.CommReduce
               for block in blocks for iv in sch.get(block).iter_vars)


class GuardedGEMV(dl.gpu.GEMV):
    """``dl.gpu.GEMV``; a function it takes whose reductions sum ≤ :data:`TINY` elements gets
    ``dl.gpu.Fallback``'s schedule instead (module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if _has_reduction(func) is False:
            return None
        space = super().apply(func, target, tunable)
        if space is None:
            return None
        length = reduction_length(func)
        if length is not None and length <= TINY:
            return dl.gpu.Fallback().apply(func, target, tunable)
        return space
