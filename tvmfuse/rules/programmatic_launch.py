"""Programmatic dependent launch (PDL, sm_90+): the next kernel starts while this one ends.

Without it, a kernel is launched only once its predecessor on the stream has completed and its
writes are flushed: at decode, where a GEMV streams 8–30 MB in a few µs, that gap (block
scheduling, the first DRAM round trip) is a large share of each kernel. With the launch
attribute ``cudaLaunchAttributeProgrammaticStreamSerialization`` (TVM 0.27's launch tag
``tirx.use_programtic_dependent_launch``, spelled as TVM spells it) a kernel may begin as soon as
every block of its predecessor has executed ``griddepcontrol.launch_dependents`` (or exited);
it must then execute ``griddepcontrol.wait`` — which returns once the predecessor has completed
and its memory is visible — before it reads or writes anything the predecessor touches. CUDA
graph capture keeps the relation (a programmatic edge), so the decode step's graph replays it.

Two pieces, both here:

* :func:`mark_programmatic_launch` (Relax stage ``programmatic_launch``): the PrimFuncs in scope
  ask for the launch attribute (``tirx.kernel_launch_params``; SplitHostDevice carries it to each
  kernel). Scope (``Options.programmatic_launch``): ``"decode"`` (default) — the kernels that
  ``tvmfuse.compile_lm``'s decode step calls (its Relax functions ``decode`` and ``advance``);
  ``"all"`` — every kernel; ``"off"``. Measured on the H200 (4-layer LM, same device call): the
  decode step 0.1935 → 0.1866 ms/token with PDL, while its 2048-token prefill went 3.07 → 3.34 ms
  (3.17 → 3.23 in another call): so not by default where kernels are long.
* :func:`insert_grid_dependency_wait` (a device pass of the TIR pipeline, after SplitHostDevice):
  a kernel that asks for it and has no ``griddepcontrol.wait`` of its own gets
  ``wait; launch_dependents`` as its first statements — so it touches no memory before its
  predecessor is done, and lets its own successor launch. Generators that know which reads are
  safe before the wait (the GEMV's weights: :func:`~tvmfuse.kernels.gemm.gemv.gemv_kernel`'s
  ``l2_prefetch``) place the wait themselves; this pass then leaves the kernel alone.

A prefetch into L2 is safe before the wait even for memory the predecessor writes: L2 is the
point of coherence of global memory, so a line prefetched early is updated by a later write.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ..options import current_options
from .gemm_sm80 import _sm

NAME = "programmatic_launch"
PDL_TAG = "tirx.use_programtic_dependent_launch"  # sic: TVM's spelling (runtime/metadata.h)
_LAUNCH_PARAMS = "tirx.kernel_launch_params"
_GRIDDEP = "tirx.ptx.griddepcontrol"


def supported(target: tvm.target.Target | None) -> bool:
    """True for CUDA targets of compute capability ≥ 9.0 (``griddepcontrol`` is sm_90 PTX)."""
    return target is not None and target.kind.name == "cuda" and _sm(target) >= 90


def griddepcontrol(action: str) -> tirx.Stmt:
    """``griddepcontrol.<action>;`` as a statement (``wait`` or ``launch_dependents``)."""
    return tirx.Evaluate(tirx.call_intrin("void", _GRIDDEP, action, ""))


def _has_wait(stmt: tirx.Stmt | None) -> bool:
    """True when a ``griddepcontrol.wait`` statement is anywhere in ``stmt`` (TVM 0.27's Python
    has no TIR visitor: the statement kinds are walked by their child fields)."""
    if stmt is None:
        return False
    if isinstance(stmt, tirx.Evaluate):
        v = stmt.value
        return isinstance(v, tvm.ir.Call) and getattr(v.op, "name", "") == _GRIDDEP and bool(
            v.args) and str(v.args[0]).strip('"') == "wait"
    if isinstance(stmt, tirx.SeqStmt):
        return any(_has_wait(s) for s in stmt)
    return any(_has_wait(getattr(stmt, f, None)) for f in ("body", "then_case", "else_case"))


def asks_for_pdl(func: tirx.PrimFunc) -> bool:
    """True when ``func`` carries the PDL launch tag."""
    return PDL_TAG in [str(t) for t in (func.attrs.get(_LAUNCH_PARAMS) or [])]


SCOPES = ("decode", "all", "off")
DECODE_FUNCTIONS = ("decode", "advance")  # compile_lm's decode step (llm/compile_lm.py)


def scope(option: str | bool) -> str:
    """``Options.programmatic_launch`` as one of :data:`SCOPES` (True: "all", False: "off")."""
    if option is True or option is False:
        return "all" if option else "off"
    if option not in SCOPES:
        raise ValueError(f"programmatic_launch must be one of {', '.join(SCOPES)}, not {option!r}")
    return option


def active(target: tvm.target.Target | None) -> bool:
    """Kernels for ``target`` launch programmatically under the options in effect:
    ``Options.programmatic_launch`` is not "off" and the target is sm_90+ CUDA."""
    return scope(current_options().programmatic_launch) != "off" and supported(target)


def launches_programmatically(function: str) -> bool:
    """The kernels the Relax function named ``function`` calls launch programmatically under the
    options in effect (the scope of ``Options.programmatic_launch``; the target aside)."""
    where = scope(current_options().programmatic_launch)
    return where == "all" or (where == "decode" and function in DECODE_FUNCTIONS)


def _called(mod: tvm.IRModule, names: tuple[str, ...]) -> set:
    """GlobalVars of the PrimFuncs that the Relax functions ``names`` of ``mod`` call."""
    found: set = set()

    def visit(expr) -> None:
        if isinstance(expr, relax.Call):
            for arg in expr.args:
                if isinstance(arg, tvm.ir.GlobalVar):
                    found.add(arg)

    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and gv.name_hint in names:
            relax.analysis.post_order_visit(func, visit)
    return found


def mark_programmatic_launch(option: str | bool) -> tvm.transform.Pass:
    """The PrimFuncs in the scope of ``option`` (module doc) ask for the PDL launch attribute
    (on a copy of the module)."""
    where = scope(option)

    @tvm.transform.module_pass(opt_level=0, name="tvmfuse.MarkProgrammaticLaunch")
    def mark(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        chosen = None if where == "all" else _called(mod, DECODE_FUNCTIONS) if where == "decode" \
            else set()
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or asks_for_pdl(func) or (
                    chosen is not None and gv not in chosen):
                continue
            tags = [str(t) for t in (func.attrs.get(_LAUNCH_PARAMS) or [])] + [PDL_TAG]
            out[gv] = func.with_attr(_LAUNCH_PARAMS, tags)
        return out

    return mark


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.InsertGridDependencyWait")
def insert_grid_dependency_wait(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Device kernels that ask for PDL and do not wait themselves: ``wait; launch_dependents``
    before their body (on a copy)."""
    out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or not asks_for_pdl(func) or _has_wait(func.body):
            continue
        body = tirx.SeqStmt([griddepcontrol("wait"), griddepcontrol("launch_dependents"), func.body])
        out[gv] = func.with_body(body)
    return out


def with_device_wait(factory):
    """A TIR pipeline factory whose device finalisation first runs
    :func:`insert_grid_dependency_wait` (the rest of ``factory``'s passes unchanged)."""

    def pipeline():
        lower, finalize_host, finalize_device = factory()

        def device_passes():
            return tvm.transform.Sequential([insert_grid_dependency_wait, finalize_device()])

        return lower, finalize_host, device_passes

    return pipeline
