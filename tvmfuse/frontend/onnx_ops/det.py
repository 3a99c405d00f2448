"""ONNX ``Det`` (opset 11+): determinants of the square matrices ``X`` (…, M, M) → (…).

Per matrix, LU factorisation with partial pivoting (as LAPACK's ``getrf`` numpy uses)::

    for k in 0 … M−1:
        p = argmax_{i ≥ k} |A[i, k]|        (the first on ties); swap rows k, p (sign = −sign)
        A[i, j] −= A[i, k] / A[k, k] · A[k, j]     for i, j > k      (skipped when A[k, k] = 0)
    det = sign · Π_k A[k, k]

One sequential kernel (``te.extern``) factorises every matrix in a workspace output (B, M, M);
16-bit inputs are factorised in float32 and the result cast back.
"""

from __future__ import annotations

from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ...relax_shapes import static_shape
from ._common import refuse


def _lu_ir(x, lu, out):
    """The factorisation of the module docstring: ``x`` (B, M, M) → ``out`` (B,), ``lu`` scratch."""
    n_mat, size = int(x.shape[0]), int(x.shape[1])
    dtype = str(lu.dtype)
    zero, one = tirx.const(0, dtype), tirx.const(1, dtype)
    with IRBuilder() as ib:
        x, lu, out = T.buffer_proxy(x), T.buffer_proxy(lu), T.buffer_proxy(out)
        with T.serial(0, n_mat) as b:
            pivot = T.buffer_proxy(T.decl_buffer([1], "int32", scope="local"))
            acc = T.buffer_proxy(T.decl_buffer([1], dtype, scope="local"))
            with T.serial(0, size) as i, T.serial(0, size) as j:
                lu[b, i, j] = x[b, i, j].astype(dtype)
            acc[0] = one
            with T.serial(0, size) as k:
                pivot[0] = k
                with T.serial(0, size) as i:
                    with T.If(tirx.all(i > k, tirx.abs(lu[b, i, k]) > tirx.abs(lu[b, pivot[0], k]))):
                        with T.Then():
                            pivot[0] = i
                with T.If(pivot[0] != k):
                    with T.Then():
                        acc[0] = zero - acc[0]
                        with T.serial(0, size) as j:
                            swap = T.buffer_proxy(T.decl_buffer([1], dtype, scope="local"))
                            swap[0] = lu[b, k, j]
                            lu[b, k, j] = lu[b, pivot[0], j]
                            lu[b, pivot[0], j] = swap[0]
                acc[0] = acc[0] * lu[b, k, k]
                with T.If(lu[b, k, k] != zero):
                    with T.Then():
                        with T.serial(0, size) as i:
                            with T.If(i > k):
                                with T.Then():
                                    factor = T.buffer_proxy(T.decl_buffer([1], dtype, scope="local"))
                                    factor[0] = lu[b, i, k] / lu[b, k, k]
                                    with T.serial(0, size) as j:
                                        with T.If(j > k):
                                            with T.Then():
                                                lu[b, i, j] = lu[b, i, j] - factor[0] * lu[b, k, j]
            out[b] = acc[0].astype(str(out.dtype))
    return ib.get()


class Det(stock.OnnxOpConverter):
    """``Det`` of float matrices of static shape."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        x = inputs[0]
        shape = static_shape(x)
        dtype = str(x.ty.dtype)
        square = shape is not None and len(shape) >= 2 and shape[-1] == shape[-2]
        if not square or not dtype.startswith(("float", "bfloat")):
            raise refuse(attr, "Det", f"input {x.ty} (float (…, M, M) of static shape)")
        batch = shape[:-2]
        n_mat = 1
        for d in batch:
            n_mat *= d
        size = shape[-1]
        work = "float32" if dtype in ("float16", "bfloat16") else dtype
        mats = bb.normalize(relax.op.reshape(x, [n_mat, size, size]))

        def kernel(data: te.Tensor) -> list:
            return te.extern([(n_mat, size, size), (n_mat,)], [data],
                             lambda ins, outs: _lu_ir(ins[0], outs[0], outs[1]),
                             dtype=[work, dtype], name="det")

        found = bb.emit_te(kernel, mats)
        return relax.op.reshape(relax.TupleGetItem(found, 1), batch)
