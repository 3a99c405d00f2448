"""ONNX ``TfIdfVectorizer`` (opset 9) over integer input: n-gram counts against a constant pool.

The pool (``pool_int64s``, split by ``ngram_counts`` into the 1-grams, 2-grams, …) gives every
n-gram ``g`` (length ``n_g``, ``min_gram_length ≤ n_g ≤ max_gram_length``) an output column
``ngram_indexes[g]`` (a repeated n-gram: its last entry, as the reference's trie keeps). For a
row ``x`` (C,) of the input (C,) or (B, C)::

    f[g] = #{(s, d) : x[s + k·d] == pool_g[k] for k < n_g, s + (n_g − 1)·d < C}
           d = 1 for 1-grams, d = 1 … max_skip_count + 1 otherwise
    tf[i] = Σ_{g : ngram_indexes[g] == i} f[g]           (C,) → (O,), (B, C) → (B, O)
    Y = tf (TF) | (tf > 0)·w (IDF) | tf·w (TFIDF)          w = weights, else 1

One counting kernel per gram length (a reduction over start and skip), a constant 0/1 matmul to
the output columns, then the weighting. String pools are refused (tensors of strings).
"""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape
from ._common import refuse


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _grams(attr: dict) -> dict[int, dict[tuple[int, ...], int]]:
    """length → {n-gram: its global pool position}, the lengths in range only (last one wins)."""
    pool = [int(v) for v in attr.get("pool_int64s", [])]
    counts = [int(v) for v in attr["ngram_counts"]]
    low, high = attr["min_gram_length"], attr["max_gram_length"]
    grams: dict[int, dict[tuple[int, ...], int]] = {}
    position = 0
    for size, start in enumerate(counts, start=1):
        end = counts[size] if size < len(counts) else len(pool)
        for k in range(max(end - start, 0) // size):
            if low <= size <= high:
                gram = tuple(pool[start + k * size: start + (k + 1) * size])
                grams.setdefault(size, {})[gram] = position
            position += 1
    return grams


def _count_kernel(size: int, skips: int, grams: te.Tensor, x: te.Tensor) -> te.Tensor:
    """(B, G) float32 occurrences of each of ``grams`` (G, size) in the rows of ``x`` (B, C)."""
    n_rows, width = x.shape
    skip = te.reduce_axis((0, skips), "skip")
    start = te.reduce_axis((0, width), "start")

    def count(b, g):
        step = skip + 1
        fits = start + (size - 1) * step < width
        # reads clamped into the row; the windows that do not fit count 0
        match = tirx.all(fits, *[x[b, tirx.min(start + k * step, width - 1)].astype("int64")
                                 == grams[g, k] for k in range(size)])
        one, zero = tirx.const(1, "float32"), tirx.const(0, "float32")
        return te.sum(tirx.Select(match, one, zero), axis=[skip, start])

    return te.compute((n_rows, grams.shape[0]), count, name=f"ngram{size}_count")


class TfIdfVectorizer(stock.OnnxOpConverter):
    """``TfIdfVectorizer`` with an integer pool and a static input shape."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        x = inputs[0]
        shape = static_shape(x)
        if attr.get("pool_strings"):
            raise refuse(attr, "TfIdfVectorizer", "attribute pool_strings (string tensors)")
        if shape is None or len(shape) not in (1, 2) or not str(x.ty.dtype).startswith("int"):
            raise refuse(attr, "TfIdfVectorizer", f"input {x.ty} (an int tensor of static 1-D / 2-D shape)")
        mode = _text(attr["mode"])
        if mode not in ("TF", "IDF", "TFIDF"):
            raise refuse(attr, "TfIdfVectorizer", f"attribute mode={mode!r}")
        columns = [int(v) for v in attr["ngram_indexes"]]
        n_out = max(columns) + 1
        rows = x if len(shape) == 2 else bb.normalize(relax.op.reshape(x, [1, shape[0]]))
        counts, positions = [], []
        for size, found in sorted(_grams(attr).items()):
            pool = relax.const(np.array(list(found), "int64").reshape(len(found), size), "int64")
            skips = 1 if size == 1 else attr.get("max_skip_count", 0) + 1
            counts.append(bb.emit_te(_count_kernel, size, skips, pool, rows))
            positions += list(found.values())
        to_columns = np.zeros((len(positions), n_out), "float32")
        for row, position in enumerate(positions):
            to_columns[row, columns[position]] = 1
        if counts:
            tf = relax.op.matmul(relax.op.concat(counts, axis=1) if len(counts) > 1 else counts[0],
                                 relax.const(to_columns, "float32"))
        else:
            tf = relax.op.zeros(relax.ShapeExpr([rows.ty.shape.values[0], n_out]), "float32")
        weights = attr.get("weights")
        w = relax.const(np.array(weights, "float32"), "float32") if weights else None
        if mode == "IDF":
            tf = relax.op.astype(relax.op.greater(tf, relax.const(0, "float32")), "float32")
        if mode != "TF" and w is not None:
            tf = relax.op.multiply(tf, w)
        return tf if len(shape) == 2 else relax.op.reshape(tf, [n_out])
