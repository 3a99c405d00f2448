"""Where a failing pipeline stage fails: the Relax function, binding and operator.

TVM's passes fail with C++ check messages that name no binding (``Check failed: (tensor) is false:
Expected TensorType, but got R.Callable(...)``). When a stage raises, :func:`locate` runs it again
on reduced copies of its input module and returns the first place that makes it fail:

1. per Relax function, the shortest prefix of its bindings on which the stage still fails the same
   way (same exception type and first message line; binary search, so about log2(#bindings)
   reruns): binding ``k`` is the culprit when the first ``k`` bindings fail and the first ``k - 1``
   do not. The prefix function returns binding ``k``'s value; the other functions are kept.
2. otherwise (a stage that works on kernels, not on bindings), each PrimFunc alone in a module;
   the binding is the one calling the failing kernel.

Only runs after a failure, so its cost (a few reruns of one stage) is paid only then. The input
module is never modified: every attempt runs on a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax, tirx

_MAX_EXPR_CHARS = 160


@dataclass(frozen=True)
class Location:
    """Where a stage fails: the Relax ``function``, the ``binding`` (its var name; ``index``: its
    position in the function, counting from 1, as var names need not be unique), the ``op``
    (``relax.add``, ``relax.call_tir(layer_norm_stats)``, …) and the binding's text, one line."""

    function: str
    binding: str
    op: str
    expr: str
    index: int = 0


def headline(err: BaseException) -> str:
    """The first non-empty line of an error's message (TVM's check, without its backtrace)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def op_name(value: relax.Expr) -> str:
    """The operator a binding applies: ``relax.x``, ``relax.call_tir(kernel)``, a callee or kind."""
    if isinstance(value, relax.Call):
        if isinstance(value.op, tvm.ir.Op):
            name = value.op.name
            if value.args and isinstance(value.args[0], tvm.ir.GlobalVar):
                name += f"({value.args[0].name_hint})"
            return name
        if isinstance(value.op, tvm.ir.GlobalVar):
            return value.op.name_hint
        return type(value.op).__name__
    return type(value).__name__


def _one_line(value: relax.Expr) -> str:
    try:
        text = " ".join(value.script(show_meta=False).split())
    except Exception:  # printing must never hide the original failure
        text = type(value).__name__
    return text if len(text) <= _MAX_EXPR_CHARS else text[: _MAX_EXPR_CHARS - 3] + "..."


def _bindings(func: relax.Function) -> list[relax.Binding]:
    return [b for block in func.body.blocks for b in block.bindings]


def _prefix(func: relax.Function, k: int) -> relax.Function:
    """``func`` with only its first ``k`` bindings, returning the ``k``-th binding's var."""
    blocks, left, out = [], k, relax.Tuple([])
    for block in func.body.blocks:
        if left == 0:
            break
        taken = list(block.bindings[:left])
        left -= len(taken)
        if left == 0:
            last = taken[-1].var
            out = relax.Var(f"{last.name}_out", last.ty)
            taken.append(relax.VarBinding(out, last))  # a dataflow var leaves its block this way
        blocks.append(relax.DataflowBlock(taken) if isinstance(block, relax.DataflowBlock)
                      else relax.BindingBlock(taken))
    bb = relax.BlockBuilder()
    out = bb.normalize(out)  # the empty tuple of k = 0 gets its type
    return bb.normalize(relax.Function(func.params, relax.SeqExpr(blocks, out), out.ty, func.is_pure,
                                       func.attrs))


def _replace(mod: tvm.IRModule, gv: tvm.ir.GlobalVar, func: relax.Function) -> tvm.IRModule:
    """A copy of ``mod`` with ``func`` (its own signature) in place of ``gv``'s function."""
    funcs = {k: f for k, f in mod.functions.items() if not k.same_as(gv)}
    return tvm.IRModule({**funcs, gv.name_hint: func}, attrs=mod.attrs, global_infos=mod.global_infos)


def locate(run: Callable[[tvm.IRModule], object], mod: tvm.IRModule,
           err: BaseException) -> Location | None:
    """The first binding of ``mod`` on which ``run`` (one stage) fails as it did with ``err``."""
    want = (type(err), headline(err))

    def fails(candidate: tvm.IRModule) -> bool:
        try:
            run(candidate)
        except Exception as other:  # the same failure, or a different one (not this culprit)
            return (type(other), headline(other)) == want
        return False

    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            found = _in_function(mod, gv, func, fails)
            if found is not None:
                return found
    return _in_kernels(mod, fails)


def _in_function(mod: tvm.IRModule, gv: tvm.ir.GlobalVar, func: relax.Function,
                 fails: Callable[[tvm.IRModule], bool]) -> Location | None:
    bindings = _bindings(func)
    try:
        if not bindings or fails(_replace(mod, gv, _prefix(func, 0))):
            return None  # fails without any binding of this function: not here
        if not fails(_replace(mod, gv, _prefix(func, len(bindings)))):
            return None
    except Exception:  # a prefix this stage cannot even be given (ill-formed for it)
        return None
    lo, hi = 0, len(bindings)  # invariant: prefix lo passes, prefix hi fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fails(_replace(mod, gv, _prefix(func, mid))):
            hi = mid
        else:
            lo = mid
    binding = bindings[hi - 1]
    value = binding.value
    return Location(gv.name_hint, binding.var.name, op_name(value), _one_line(value), hi)


def _in_kernels(mod: tvm.IRModule, fails: Callable[[tvm.IRModule], bool]) -> Location | None:
    if fails(tvm.IRModule({}, attrs=mod.attrs, global_infos=mod.global_infos)):
        return None  # fails on no function at all: nothing to localise
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and fails(tvm.IRModule({gv: func})):
            return _caller(mod, gv) or Location(gv.name_hint, "", f"PrimFunc {gv.name_hint}", "")
    return None


def _caller(mod: tvm.IRModule, kernel: tvm.ir.GlobalVar) -> Location | None:
    """The first binding of a Relax function that calls ``kernel``."""
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        for index, binding in enumerate(_bindings(func), 1):
            value = binding.value
            if isinstance(value, relax.Call) and any(
                    isinstance(a, tvm.ir.GlobalVar) and a.same_as(kernel) for a in [value.op, *value.args]):
                return Location(gv.name_hint, binding.var.name, op_name(value), _one_line(value), index)
    return None
