"""The one fallback point of the schedule rules: how "not mine" and "broken" are told apart.

The applicability protocol:

* a rule keeps dlight's contract, ``apply(func, target, tunable) → Schedule | None``; ``None``
  means "not mine" and the next rule is tried;
* a rule (or the pass around a kernel generator) that leaves a function it was made for says why
  on it, ``tvmfuse.fallback = <reason>`` (:data:`FALLBACK_ATTR`; e.g. ``gemm_sm80``'s reasons, or a
  generator's ``check(problem) → reason | None``);
* an exception raised inside a rule is a bug, never a way to say "not mine" (in strict mode only
  tvmfuse's own rules fail the build; dlight's are TVM's bugs and recorded). Every rule is
  called through :func:`try_rule` (by :class:`ApplyRules`, the pipeline's ``schedule`` stage and
  ``tvmfuse tune``'s default schedule and design space): with ``Options.strict``
  (``TVMFUSE_STRICT=1``, set by the test suite and CI) the exception propagates; otherwise the
  function gets ``tvmfuse.fallback = "<rule> raised <type>: <message>"``, the next rules are tried
  on it, and ``tvmfuse report`` prints the reason with the kernel.

This module is the only place an exception of a rule is caught broadly.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.ir import IRModule
from tvm.ir.transform import PassContext, module_pass
from tvm.target import Target

from ..attrs import FALLBACK_ATTR
from ..errors import CompileError
from ..options import current_options
from .single_thread import runs_on_device

_MAX_REASON = 300


def rule_name(rule) -> str:
    """A rule's name for reasons: its class name (``GemmSM80``, ``Matmul``)."""
    return type(rule).__name__


def describe(err: BaseException) -> str:
    """``<type>: <message>``, the message's last non-empty line (TVM puts its own there)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:_MAX_REASON]


def record_fallback(func: tirx.PrimFunc, reason: str) -> tirx.PrimFunc:
    """``func`` with ``reason`` added to its :data:`FALLBACK_ATTR` (earlier reasons kept)."""
    old = func.attrs.get(FALLBACK_ATTR) if func.attrs is not None else None
    return func.with_attr(FALLBACK_ATTR, f"{old}; {reason}" if old else reason)


def _third_party(rule) -> bool:
    """A rule from TVM's dlight, or a thin tvmfuse guard around one (``wraps_dlight``): its
    internal assertions (e.g. ``collect_block_iter_vars_used_in_access_region``'s on Resize and
    TfIdf kernels, GEMV's ``compute_at`` on a RoPE-pair stack before an RMSNorm) are TVM's
    defects, not tvmfuse's; strict mode records them as fallbacks like any user run instead of
    failing the build."""
    return type(rule).__module__.startswith("tvm.") or getattr(rule, "wraps_dlight", False)


def try_rule(rule, func: tirx.PrimFunc, target: Target, tunable: bool) -> tuple[
        list[s_tir.Schedule] | None, str | None]:
    """``(schedules, None)`` when ``rule`` takes ``func``, ``(None, None)`` when it is not its,
    ``(None, reason)`` when it raised (outside strict mode; in strict mode the error propagates)."""
    try:
        space = rule.apply(func, target, tunable)
    except Exception as err:  # the documented fallback point (module docstring)
        if current_options().strict and not _third_party(rule):
            raise
        return None, f"{rule_name(rule)} raised {describe(err)}"
    if space is None:
        return None, None
    return ([space] if isinstance(space, s_tir.Schedule) else list(space)), None


def apply_rules(func: tirx.PrimFunc, target: Target, rules: list, tunable: bool) -> tuple[
        list[s_tir.Schedule] | None, tirx.PrimFunc]:
    """The first rule's schedules for ``func`` (None: no rule took it) and ``func`` with the
    reasons of the rules that raised recorded (what the later rules were given)."""
    for rule in rules:
        space, reason = try_rule(rule, func, target, tunable)
        if reason is not None:
            func = record_fallback(func, reason)
        elif space is not None:
            return space, func
    return None, func


def _check_on_device(name: str, func: tirx.PrimFunc, target: Target) -> None:
    """A CUDA kernel no rule took must still run in GPU threads: TVM would otherwise build it as
    a host function that dereferences device pointers (a segfault at run time), so this is a
    CompileError naming the kernel and why the rules left it."""
    if target.kind.name != "cuda" or (func.attrs is not None and func.attrs.get("tirx.is_host_func")):
        return
    if runs_on_device(func, target):
        return
    why = func.attrs.get(FALLBACK_ATTR) if func.attrs is not None else None
    raise CompileError(f"kernel {name!r}: no schedule rule binds it to GPU threads, and unbound it "
                       f"would run on the host against device memory"
                       + (f" (rules that raised: {why})" if why else ""), stage="schedule",
                       function=name)


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    return bool(func.attrs is not None and func.attrs.get("tirx.is_scheduled", False))


@module_pass(opt_level=0, name="tvmfuse.ApplyRules")
class ApplyRules:
    """dlight's ApplyDefaultSchedule through :func:`try_rule`: rules tried in order on every
    unscheduled PrimFunc (on a copy of the module). Pipeline stage ``schedule``, after every pass
    that replaces kernels (tuning records, the sm_90a GEMMs) and before the VM lowering."""

    def __init__(self, *rules) -> None:
        self.rules = list(rules)

    def transform_module(self, mod: IRModule, _ctx: PassContext) -> IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or _is_scheduled(func):
                continue
            target = func.attrs.get("target") if func.attrs is not None else None
            space, marked = apply_rules(func, target or Target.current(allow_none=False),
                                        self.rules, tunable=False)
            if space is not None:
                updates[gvar] = space[0].mod["main"].with_attr("tirx.is_scheduled", True)
                continue
            _check_on_device(gvar.name_hint, marked, target or Target.current(allow_none=False))
            if not marked.same_as(func):  # no rule took it; keep why the ones that raised
                updates[gvar] = marked
        if not updates:
            return mod
        mod = mod.clone()
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod
