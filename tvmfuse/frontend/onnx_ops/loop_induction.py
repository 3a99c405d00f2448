"""ONNX ``Loop`` of a runtime trip count whose body only steps induction variables: closed form.

A body built of ``Identity`` and ``Add`` alone, where ``cond`` passes through unchanged, each
carried value steps by a loop-invariant ``c_j`` (a value of the outer scope) and each scan output
is a carried value before or after its step (ONNX's ``Range`` function body is one)::

    v_j' = v_j + c_j          y_k = v_j   (o = 0)   or   y_k = v_j'   (o = 1)

runs ``n = cond ? max(M, 0) : 0`` steps, so with ``n`` a symbolic length bound at run time::

    v_j(final) = v_j + n · c_j              (same shape as v_j; c_j 0-d or of v_j's shape)
    y_k        = v_j + (arange(n) + o) · c_j      shape (n, *v_j.shape)

A float sum of ``i`` steps may round differently from ``i · c`` (by a few ulps at most). Any
other body is left to :mod:`.loop`, which refuses a runtime trip count naming the node.
"""

from __future__ import annotations

from typing import Any

from tvm import relax

from ._unroll import static_dims
from .runtime_values import symbolic_dims


def _source(name: str, producers: dict[str, Any]) -> str:
    """``name`` with the ``Identity`` chain above it followed back."""
    while name in producers and producers[name].op_type == "Identity":
        name = producers[name].input[0]
    return name


def _steps(body, outer: dict[str, Any]) -> tuple[list[str], list[tuple[int, int]]] | None:
    """``(c_j names, [(j, o) per scan output])`` when ``body`` only steps induction variables."""
    if any(n.op_type not in ("Identity", "Add") or n.domain not in ("", "ai.onnx") for n in body.node):
        return None
    producers = {out: n for n in body.node for out in n.output}
    names = [v.name for v in body.input]
    carried_in, outs = names[2:], [_source(o.name, producers) for o in body.output]
    if len(names) < 2 or outs[0] != names[1]:
        return None
    steps, stepped = [], []
    for j, out in enumerate(outs[1:1 + len(carried_in)]):
        add = producers.get(out)
        if add is None or add.op_type != "Add":
            return None
        a, b = (_source(x, producers) for x in add.input)
        a, b = (a, b) if a == carried_in[j] else (b, a)
        if a != carried_in[j] or b in producers or b in names or b not in outer:
            return None
        steps.append(b)
        stepped.append(out)
    scans = []
    for out in outs[1 + len(carried_in):]:
        if out in carried_in:
            scans.append((carried_in.index(out), 0))
        elif out in stepped:
            scans.append((stepped.index(out), 1))
        else:
            return None
    return steps, scans


def induction_loop(bb: relax.BlockBuilder, body, inputs: list[relax.Expr | None],
                   outer: dict[str, Any]) -> list[relax.Expr] | None:
    """The outputs of a Loop whose body only steps induction variables (module docstring), else
    None (the body does more, or a shape or dtype it needs is not static / not matching)."""
    found = _steps(body, outer)
    if found is None or inputs[0] is None:
        return None
    steps, scans = found
    carried, deltas = inputs[2:], [outer[name] for name in steps]
    for v, c in zip(carried, deltas):
        dims, step_dims = static_dims(v), static_dims(c)
        if dims is None or step_dims not in ([], dims) or str(v.ty.dtype) != str(c.ty.dtype):
            return None
    count = relax.op.maximum(relax.op.reshape(relax.op.astype(inputs[0], "int64"), []),
                             relax.const(0, "int64"))
    if inputs[1] is not None:
        count = relax.op.where(relax.op.reshape(inputs[1], []), count, relax.const(0, "int64"))
    count = bb.normalize(count)
    (length,) = symbolic_dims(bb, count, 1, "loop")
    finals = [bb.normalize(relax.op.add(v, relax.op.multiply(
        relax.op.astype(count, str(v.ty.dtype)), c))) for v, c in zip(carried, deltas)]
    outputs = []
    for j, offset in scans:
        v, c = carried[j], deltas[j]
        index = relax.op.arange(offset, length + offset, 1, str(v.ty.dtype))
        index = relax.op.reshape(index, [length] + [1] * v.ty.ndim)
        outputs.append(bb.normalize(relax.op.add(v, relax.op.multiply(index, c))))
    return finals + outputs


__all__ = ["induction_loop"]
