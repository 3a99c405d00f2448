"""ONNX ``Loop``, unrolled when its trip count and condition are known at compile time.

``Loop(M, cond, v_0 …)`` runs ``body(i, cond, v) → (cond', v', y)`` while ``i < M`` and
``cond``; the outputs are the last ``v`` and every ``y`` stacked along a new axis 0. Unrolled,
step ``i`` converts the body once with ``i`` an int64 constant and ``cond`` the constant of the
step before::

    i = 0;  while (M absent or i < M) and cond:  cond, v, y_i = body(i, cond, v);  i += 1

``M`` must be a constant (or absent), ``cond`` a constant (or absent: true), and the body's
``cond'`` must fold to a constant at every step (a condition computed from the loop counter and
constants does; one computed from runtime data does not): otherwise (unless the body only
steps induction variables: :mod:`.loop_induction`, a closed form), and beyond
:data:`~._unroll.UNROLL_LIMIT` steps, the node is refused naming the input. A loop of no steps
with scan outputs is refused too (their shape is unknown).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from tvm import relax

from ._unroll import UNROLL_LIMIT, RunBody, attributes, int64_scalar, refuse, stack
from .loop_induction import induction_loop

Constant = Callable[[relax.Expr | None], np.ndarray | None]


def _known(label: str, what: str, value: relax.Expr | None, constant: Constant) -> np.ndarray | None:
    """The constant value of a Loop input (None when absent); a runtime value is refused."""
    if value is None:
        return None
    known = constant(value)
    if known is None or known.size != 1:
        raise refuse(label, f"Loop {what} is a runtime value (tvmfuse unrolls loops whose trip "
                            "count and condition are known at compile time)")
    return known.reshape(())


def unroll_loop(bb: relax.BlockBuilder, node, label: str, inputs: list[relax.Expr | None],
                constant: Constant, run_body: RunBody, outer: dict[str, Any]) -> list[relax.Expr]:
    """The outputs of ``node`` (a Loop) unrolled (see the module docstring); ``outer`` is the
    scope the body sees."""
    body = attributes(node)["body"]
    inputs = inputs + [None] * (2 - len(inputs))
    if any(x is not None and constant(x) is None for x in inputs[:2]):
        closed = induction_loop(bb, body, inputs, outer)
        if closed is not None:
            return closed
    trip = _known(label, "input M (trip count)", inputs[0], constant)
    cond = _known(label, "input cond", inputs[1], constant)
    steps = UNROLL_LIMIT + 1 if trip is None else int(trip)
    if trip is None and cond is None:
        raise refuse(label, "Loop with neither M nor cond (an infinite loop)")
    carried = list(inputs[2:])
    names = [v.name for v in body.input]
    collected: list[list[relax.Expr]] = [[] for _ in range(len(body.output) - 1 - len(carried))]
    going = True if cond is None else bool(cond)
    i = 0
    while going and i < steps:
        if i == UNROLL_LIMIT:
            raise refuse(label, f"Loop of more than {UNROLL_LIMIT} steps (tvmfuse unrolls at most "
                                f"{UNROLL_LIMIT})")
        flag = relax.const(np.bool_(going), "bool")
        outs = run_body(body, dict(zip(names, [int64_scalar(i), flag, *carried])))
        going = bool(_known(label, "body output cond", outs[0], constant))
        carried = outs[1:1 + len(carried)]
        for k, y in enumerate(outs[1 + len(carried):]):
            collected[k].append(y)
        i += 1
    if collected and i == 0:
        raise refuse(label, "Loop of no steps with scan outputs (their shape is unknown)")
    return carried + [stack(bb, ys, 0, False) for ys in collected]


__all__ = ["unroll_loop"]
