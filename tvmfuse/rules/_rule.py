"""The common ``apply`` of tvmfuse's PrimFunc rules (dlight's rule protocol)."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target


class PrimFuncRule(GPUScheduleRule):
    """A GPU rule whose :meth:`_schedule` returns ``None`` where ``func`` is not its shape.

    A schedule primitive raising ``ScheduleError`` also means "not this rule's shape"; any other
    exception is a bug and goes to the fallback point (``schedules/fallback.py``).
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return self._schedule(func)
        except s_tir.ScheduleError:
            return None

    def _schedule(self, func: tirx.PrimFunc) -> s_tir.Schedule | None:
        raise NotImplementedError
