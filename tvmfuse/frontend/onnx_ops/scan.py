"""ONNX ``Scan``, unrolled over its static scan length (opset 8, 9, 11, 16).

With ``N`` state variables, ``M = num_scan_inputs`` scan inputs and ``K`` scan outputs, step
``t = 0 … L-1`` converts the body once::

    i_t              = t                 (scan_input_directions[j] = 0)   or  L-1-t   (= 1)
    states, y_t      = body(states, x_j[..., i_t, ...] along scan_input_axes[j]  for j < M)
    outputs          = states_L, stack_k(y_0 … y_{L-1}) along scan_output_axes[k]
                                                      (reversed for scan_output_directions[k] = 1)

``L`` is the static length of the scan inputs along their axes; a dynamic length, or one above
:data:`~._unroll.UNROLL_LIMIT` steps, is refused naming the node. Opset 8 has a leading batch
axis on every input and output (scan axis 1, per-input ``directions``): the body runs per batch
element and the results are stacked; its ``sequence_lens`` input (ragged batches) is refused.
"""

from __future__ import annotations

from tvm import relax

from ._unroll import UNROLL_LIMIT, RunBody, attributes, index, refuse, stack, static_dims


def _length(label: str, scans: list[relax.Expr], axes: list[int]) -> int:
    lengths = set()
    for x, axis in zip(scans, axes):
        dims = static_dims(x)
        if dims is None:
            raise refuse(label, "Scan input of dynamic shape (the scan length must be static to unroll)")
        lengths.add(dims[axis])
    if len(lengths) != 1:
        raise refuse(label, f"Scan inputs of different scan lengths {sorted(lengths)}")
    (length,) = lengths
    if not 0 < length <= UNROLL_LIMIT:
        raise refuse(label, f"Scan length {length} (tvmfuse unrolls 1 to {UNROLL_LIMIT} steps)")
    return length


def _scan(bb: relax.BlockBuilder, label: str, body, states: list[relax.Expr],
          scans: list[relax.Expr], axes: list[int], directions: list[int], out_axes: list[int],
          out_directions: list[int], run_body: RunBody) -> list[relax.Expr]:
    """The final states and stacked scan outputs of one unrolled scan (axes non-negative)."""
    length = _length(label, scans, axes)
    names = [v.name for v in body.input]
    n = len(states)
    collected: list[list[relax.Expr]] = [[] for _ in range(len(body.output) - n)]
    for t in range(length):
        steps = [index(bb, x, axis, length - 1 - t if d else t)
                 for x, axis, d in zip(scans, axes, directions)]
        outs = run_body(body, dict(zip(names, states + steps)))
        states = outs[:n]
        for k, y in enumerate(outs[n:]):
            collected[k].append(y)
    return states + [stack(bb, ys, axis, bool(d)) for ys, axis, d in zip(collected, out_axes, out_directions)]


def _axes(values, count: int, ranks: list[int]) -> list[int]:
    values = list(values) if values is not None else [0] * count
    return [a + r if a < 0 else a for a, r in zip(values, ranks)]


def unroll_scan(bb: relax.BlockBuilder, node, label: str, inputs: list[relax.Expr | None],
                opset: int, run_body: RunBody) -> list[relax.Expr]:
    """The outputs of ``node`` (a Scan) unrolled (see the module docstring)."""
    attrs = attributes(node)
    body, m = attrs["body"], int(attrs["num_scan_inputs"])
    k = len(body.output) - (len(inputs) - m - (1 if opset < 9 else 0))
    if opset >= 9:
        states, scans = inputs[: len(inputs) - m], inputs[len(inputs) - m:]
        return _scan(bb, label, body, states, scans,
                     _axes(attrs.get("scan_input_axes"), m, [x.ty.ndim for x in scans]),
                     list(attrs.get("scan_input_directions") or [0] * m),
                     list(attrs.get("scan_output_axes") or [0] * k),
                     list(attrs.get("scan_output_directions") or [0] * k), run_body)
    if inputs[0] is not None:
        raise refuse(label, "Scan input sequence_lens (ragged batches are not supported; omit it)")
    rest = inputs[1:]
    states, scans = rest[: len(rest) - m], rest[len(rest) - m:]
    dims = static_dims(rest[0])
    if dims is None:
        raise refuse(label, "Scan (opset 8) input of dynamic shape (the batch must be static)")
    per_batch = [_scan(bb, label, body, [index(bb, s, 0, b) for s in states],
                       [index(bb, x, 0, b) for x in scans], [0] * m,
                       list(attrs.get("directions") or [0] * m), [0] * k, [0] * k, run_body)
                 for b in range(dims[0])]
    return [stack(bb, list(values), 0, False) for values in zip(*per_batch)]


__all__ = ["unroll_scan"]
