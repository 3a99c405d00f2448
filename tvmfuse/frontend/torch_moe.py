"""Converters for the ops of transformers' mixture-of-experts layers, which TVM 0.27 lacks.

transformers 5 runs the experts of Mixtral, Qwen2-MoE, OLMoE, GPT-OSS, ... as one grouped product
(``integrations/moe.py``): the (token, expert) rows are sorted by expert, ``histc`` counts the rows
of each expert, ``cumsum`` makes the counts row offsets, and ``grouped_mm(x, w, offs)`` multiplies
rows ``[offs[e-1], offs[e])`` of ``x`` by ``w[e]`` (``transformers::grouped_mm_fallback``, or
``aten._grouped_mm`` where torch's kernel applies). Without these two converters every such model
fails to import.

``histc(x, bins, min, max)``: ``counts[b] = #{i : bin(x_i) = b}``, ``bin(x) = ⌊(x − min) · bins /
(max − min)⌋`` clipped to ``bins − 1`` (x = max is in the last bin), values outside [min, max]
not counted; ``x``'s dtype. The counts are a (N, bins) comparison summed over N.

``grouped_mm(x, w, offs)``, x (S, K), w (E, K, N), offs (E,) ascending → (S, N):
``out[r] = x[r] · w[e(r)]`` with ``e(r) = #{e : offs[e] ≤ r}``; rows past ``offs[E−1]`` are 0 (the
fallback's zero-filled output; they exist only with expert parallelism's sentinels). Shapes
stay static: every row is multiplied by every expert as one 2-D GEMM ``x · W'``, ``W' = w`` laid
out (K, E·N) (a constant for weights, folded at compile time), and row r keeps its expert's N
columns (``gather_elements``). That is E× the FLOPs of a grouped GEMM and reads every expert's
weights: correct on every target, not yet a grouped-GEMM kernel.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import relax

from .torch_fixes import accumulate_dtype


def _histc(node, importer) -> relax.Var:
    """``aten.histc(x, bins=100, min=0, max=0)`` with fixed bounds (min < max)."""
    args = importer.retrieve_args(node)
    x = args[0]
    bins, lo, hi = (args[i] if len(args) > i else node.kwargs.get(k, d)
                    for i, (k, d) in enumerate((("bins", 100), ("min", 0), ("max", 0)), start=1))
    if not hi > lo:
        raise ValueError(f"{node.name}: histc with min {lo} >= max {hi} (bounds taken from the data) "
                         "is not supported; pass fixed bounds")
    bb = importer.block_builder
    dtype = str(x.ty.dtype)
    xf = x if dtype == "float32" else bb.emit(relax.op.astype(x, "float32"))
    (n,) = importer.shape_of(x)
    pos = bb.emit(relax.op.divide(
        relax.op.multiply(relax.op.subtract(xf, relax.const(float(lo), "float32")),
                          relax.const(float(bins), "float32")),
        relax.const(float(hi - lo), "float32")))
    idx = bb.emit(relax.op.minimum(relax.op.astype(relax.op.floor(pos), "int64"),
                                   relax.const(int(bins) - 1, "int64")))
    inside = bb.emit(relax.op.logical_and(relax.op.greater_equal(xf, relax.const(float(lo), "float32")),
                                          relax.op.less_equal(xf, relax.const(float(hi), "float32"))))
    grid = relax.op.reshape(relax.op.arange(0, int(bins), 1, "int64"), (1, int(bins)))
    hit = bb.emit(relax.op.logical_and(relax.op.equal(relax.op.reshape(idx, (n, 1)), grid),
                                       relax.op.reshape(inside, (n, 1))))
    return bb.emit(relax.op.sum(relax.op.astype(hit, dtype), axis=[0]))


def _grouped_mm(node, importer) -> relax.Var:
    """``grouped_mm_fallback(x, w, offs)`` / ``aten._grouped_mm(x, w, offs)``: 2-D x, 3-D w."""
    args = importer.retrieve_args(node)
    x, w = args[0], args[1]
    offs = args[2] if len(args) > 2 else node.kwargs.get("offs")
    extra = [a for a in args[3:] if a is not None] + [
        v for k, v in node.kwargs.items() if k in ("bias", "out_dtype") and v is not None]
    xs, ws = importer.shape_of(x), importer.shape_of(w)
    if offs is None or extra or len(xs) != 2 or len(ws) != 3:
        raise ValueError(f"{node.name}: grouped_mm is supported for a 2-D input, 3-D weights and "
                         f"offsets, no bias or out_dtype (got input {list(xs)}, weight {list(ws)})")
    s, (k, e, n) = xs[0], (int(ws[1]), int(ws[0]), int(ws[2]))  # S may be symbolic (compile_lm)
    bb = importer.block_builder
    dtype = str(x.ty.dtype)
    acc = accumulate_dtype(dtype)
    # e(r) = #{e : offs[e] <= r}: the expert of row r (E for the rows past the last offset)
    rows = relax.op.reshape(relax.op.arange(0, s, 1, "int64"), (s, 1))
    ends = relax.op.reshape(relax.op.astype(offs, "int64"), (1, e))
    expert = bb.emit(relax.op.sum(relax.op.astype(relax.op.less_equal(ends, rows), "int64"), axis=[1]))
    wide = bb.emit(relax.op.reshape(relax.op.permute_dims(w, [1, 0, 2]), (k, e * n)))  # (K, E·N)
    y = bb.emit(relax.op.matmul(x, wide, out_dtype=acc))
    if acc != dtype:
        y = bb.emit(relax.op.astype(y, dtype))
    pick = relax.op.broadcast_to(
        relax.op.reshape(relax.op.minimum(expert, relax.const(e - 1, "int64")), (s, 1, 1)), (s, 1, n))
    out = bb.emit(relax.op.reshape(
        relax.op.gather_elements(relax.op.reshape(y, (s, e, n)), pick, axis=1), (s, n)))
    kept = relax.op.reshape(relax.op.less(expert, relax.const(e, "int64")), (s, 1))
    return bb.emit(relax.op.where(kept, out, relax.const(0, dtype)))


def moe_convert_map() -> dict[str, Callable]:
    """The converters above, by the names ``from_exported_program`` looks them up with."""
    return {"histc.default": _histc, "grouped_mm_fallback.default": _grouped_mm,
            "_grouped_mm.default": _grouped_mm}
