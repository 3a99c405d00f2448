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


def _reduce_extents(func: tirx.PrimFunc) -> list[list] | None:
    """The reduce-iterator extents of each reduction block under the root of ``func`` (empty: no
    reduction); None when ``func`` has no root block to look under."""
    try:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except TVM_ERRORS:
        return None
    extents = ([iv.dom.extent for iv in sch.get(block).iter_vars
                if iv.iter_type == tirx.IterVar.CommReduce] for block in blocks)
    return [e for e in extents if e]


def reduction_length(func: tirx.PrimFunc) -> int | None:
    """Elements summed per output by the reduction blocks of ``func`` (the largest static product
    of their reduce extents); None when there is no reduction or an extent is symbolic."""
    extents = _reduce_extents(func)
    if not extents or not all(isinstance(e, tirx.IntImm) for block in extents for e in block):
        return None
    return max(math.prod(int(e) for e in block) for block in extents)


class GuardedGEMV(dl.gpu.GEMV):
    """``dl.gpu.GEMV``; a function it takes whose reductions sum ≤ :data:`TINY` elements gets
    ``dl.gpu.Fallback``'s schedule instead (module docstring)."""

    wraps_dlight = True  # what raises in here is dlight's GEMV (rules/fallback.py: _third_party)

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if _reduce_extents(func) == []:  # no reduction: no GEMV (module docstring)
            return None
        space = super().apply(func, target, tunable)
        if space is None:
            return None
        length = reduction_length(func)
        if length is not None and length <= TINY:
            return dl.gpu.Fallback().apply(func, target, tunable)
        return space
