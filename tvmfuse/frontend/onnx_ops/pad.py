"""ONNX ``Pad`` with ``pads``, ``constant_value`` or ``axes`` a runtime tensor.

The begin / end pads of every axis ``k`` are resolved at run time (with ``axes``: the pads of
the axes named, 0 elsewhere; ``axes`` distinct and in range or the call fails) and become the
symbolic dims ``pad_k`` / ``pad_{r+k}``; the output is ``n_k + begin_k + end_k`` (negative pads
crop; a negative output dim fails the call). One TE kernel reads source index ``s = i - begin``::

    constant: x[s] if 0 <= s < n (every axis) else value
    edge:     x[clamp(s, 0, n - 1)]
    reflect:  x[m if m < n else 2(n - 1) - m],  m = s mod 2(n - 1)
    wrap:     x[s mod n]
"""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx

from .runtime_values import (
    Fallback,
    all_of,
    as_int64,
    axes_mask,
    dims_tensor,
    int64,
    normalized_axes,
    static_length,
    symbolic_dims,
)


def _source(mode: str, s: tirx.PrimExpr, n: tirx.PrimExpr) -> tirx.PrimExpr:
    if mode == "edge":
        return tirx.max(tirx.min(s, n - 1), 0)
    if mode == "wrap":
        return tirx.floormod(s, n)
    if mode == "reflect":
        period = tirx.max(2 * (n - 1), 1)
        m = tirx.floormod(s, period)
        return tirx.Select(m < n, m, period - m)
    return s


def _full_pads(bb: relax.BlockBuilder, pads: relax.Expr, axes: relax.Expr | None, rank: int):
    """``(pads over every axis (2·rank,), ok)`` from ONNX ``pads`` and optional ``axes``."""
    pads = bb.normalize(as_int64(pads))
    if axes is None:
        if static_length(pads) != 2 * rank:
            raise ValueError(f"Pad: pads {pads.ty} must hold 2 x {rank} values (the data's rank)")
        return pads, None
    count = static_length(axes)
    if count is None:
        raise ValueError(f"Pad: runtime axes need a static length, got {axes.ty}")
    _, ok = axes_mask(bb, axes, count, rank)
    norm = relax.op.reshape(normalized_axes(bb.normalize(axes), rank), [1, count])
    every = relax.const(np.arange(rank, dtype="int64").reshape(rank, 1), "int64")
    pick = relax.op.astype(relax.op.equal(norm, every), "int64")  # (rank, count)
    halves = relax.op.reshape(pads, [2, 1, count])
    full = relax.op.sum(relax.op.multiply(relax.op.reshape(pick, [1, rank, count]), halves), axis=[2])
    return bb.normalize(relax.op.reshape(full, [2 * rank])), ok


def pad_runtime(bb: relax.BlockBuilder, inputs: list, attr: dict, fallback: Fallback) -> relax.Expr:
    """``Pad(x, pads, constant_value, axes)`` with a runtime input (see the module docstring)."""
    data = inputs[0]
    rank = data.ty.ndim
    mode = attr.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if rank < 1 or mode not in ("constant", "edge", "reflect", "wrap"):
        raise ValueError(f"Pad: runtime pads need data of known rank >= 1 and a known mode "
                         f"(data {data.ty}, mode {mode!r})")
    value = inputs[2] if len(inputs) > 2 and inputs[2] is not None else relax.const(0, str(data.ty.dtype))
    value = relax.op.reshape(relax.op.astype(value, str(data.ty.dtype)), [1])
    axes = inputs[3] if len(inputs) > 3 else None
    pads, ok = _full_pads(bb, inputs[1], axes, rank)
    dims = dims_tensor(data)
    sizes = relax.op.add(dims, relax.op.add(relax.op.strided_slice(pads, [0], [0], [rank]),
                                            relax.op.strided_slice(pads, [0], [rank], [2 * rank])))
    fits = all_of(relax.op.greater_equal(sizes, int64(0)))
    ok = fits if ok is None else relax.op.logical_and(ok, fits)
    both = relax.op.concat([pads, sizes], axis=0)
    syms = symbolic_dims(bb, both, 3 * rank, "pad", bb.normalize(ok))
    return pad_kernel(bb, data, bb.normalize(value), syms[:rank], syms[2 * rank:], mode)


def pad_kernel(bb: relax.BlockBuilder, data: relax.Expr, fill: relax.Expr, begin: list,
               out_shape: list, mode: str = "constant") -> relax.Expr:
    """``data`` padded (cropped where negative) by the symbolic ``begin`` dims to ``out_shape``;
    ``fill`` a (1,) tensor for ``mode`` constant (see the module docstring)."""
    rank = len(begin)

    def pad(x: te.Tensor, value: te.Tensor, start: list, shape: list) -> te.Tensor:
        def body(*i):
            src = [_source(mode, i[k] - start[k], x.shape[k]) for k in range(rank)]
            if mode != "constant":
                return x(*src)
            inside = tirx.all(*[tirx.all(s >= 0, s < x.shape[k]) for k, s in enumerate(src)])
            safe = [tirx.max(tirx.min(s, x.shape[k] - 1), 0) for k, s in enumerate(src)]
            return tirx.Select(inside, x(*safe), value[0])

        return te.compute(shape, body, name="pad")

    # the pads go in as arguments: emit_te passes only those (and shape dims) to the kernel
    return bb.emit_te(pad, data, fill, begin, out_shape)
