"""Shape-like ONNX inputs that arrive as runtime tensors: helpers shared by the converters.

A runtime ``axes`` / ``shape`` / ``sizes`` / ``K`` tensor is turned into symbolic dimensions at
run time (``R.tensor_to_shape`` + ``match_cast`` to fresh ``tirx.Var``s): the kernels after it
take symbolic shapes, and the value flows through the compiled library on every call (nothing
is read from the model's test data at import).

:func:`symbolic_dims` does that conversion. A value that must satisfy a condition the kernels
rely on (distinct in-range axes, say) is checked on the way: :func:`symbolic_dims` takes an
``ok`` flag that joins the same ``match_cast`` as a leading dimension that must be 1, so the
check cannot be dropped as dead code and a bad value stops the call (the VM's ``match_cast
error``) instead of returning garbage; :func:`checked` does the same for an output of static
shape. :func:`with_runtime_inputs` routes a node to such a converter when one of its shape-like
inputs is a runtime tensor (constants keep TVM's converter); a ``ValueError`` a converter raises
for a form it does not handle becomes an ``UnsupportedOpError`` naming the node.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import numpy as np
import tvm
from tvm import relax, tirx

from ...errors import UnsupportedOpError

# the node being converted, as a prefix of the symbols bound for it (the VM's match_cast error
# then names the node: "ErrorContext(match_cast, ty=R.Shape([1, sum0_reduced_0, …]))")
_NODE: ContextVar[str] = ContextVar("tvmfuse_onnx_node", default="")


def is_runtime(value: Any) -> bool:
    """A runtime tensor (no constant, no shape value, no PrimExpr)."""
    return (isinstance(value, relax.Expr) and isinstance(value.ty, relax.TensorType)
            and not isinstance(value, tvm.ir.GenericConst))


def static_length(value: relax.Expr) -> int | None:
    """The static length of a 1-D (or 0-D: 1) tensor, else None."""
    shape = value.ty.shape
    if shape is None or value.ty.ndim not in (0, 1):
        return None
    if value.ty.ndim == 0:
        return 1
    dim = shape.values[0]
    return int(dim) if isinstance(dim, tirx.IntImm) else None


def as_int64(value: relax.Expr) -> relax.Expr:
    """``value`` as int64 (a no-op when it is)."""
    return value if str(value.ty.dtype) == "int64" else relax.op.astype(value, "int64")


def int64(value: int) -> relax.Expr:
    """An int64 scalar constant."""
    return relax.const(value, "int64")


def dims_tensor(x: relax.Expr) -> relax.Expr:
    """``x``'s shape as an int64 (rank,) tensor (a constant when static)."""
    return relax.op.shape_to_tensor(relax.op.shape_of(x))


def symbolic_dims(bb: relax.BlockBuilder, dims: relax.Expr, count: int, prefix: str,
                  ok: relax.Expr | None = None) -> list[tirx.Var]:
    """The int64 tensor ``dims`` (``count`` elements) as fresh symbolic dims ``prefix_i``, bound
    at run time; with ``ok`` (a bool scalar tensor) the call fails unless ``ok`` holds."""
    dims = relax.op.reshape(as_int64(bb.normalize(dims)), [count])
    shape: list[Any] = []
    if ok is not None:
        flag = relax.op.reshape(relax.op.astype(ok, "int64"), [1])
        dims = relax.op.concat([flag, dims], axis=0)
        shape.append(tirx.IntImm("int64", 1))
    # the VM builtin itself: R.tensor_to_shape is decomposed into it plus a match_cast to fresh
    # dims, and binding canonicalisation then drops the match_cast below that renames them
    value = bb.emit(relax.Call(relax.ExternFunc("vm.builtin.tensor_to_shape"), [bb.normalize(dims)],
                               ty_args=[relax.ShapeType(ndim=len(shape) + count)]))
    out = [tirx.Var(f"{_NODE.get()}{prefix}_{i}", "int64") for i in range(count)]
    bb.match_cast(value, relax.ShapeType(shape + out))
    return out


def all_of(condition: relax.Expr) -> relax.Expr:
    """True (a bool scalar) when every element of the bool tensor ``condition`` is."""
    return relax.op.equal(relax.op.sum(relax.op.astype(relax.op.logical_not(condition), "int64")),
                          int64(0))


def normalized_axes(axes: relax.Expr, rank: int) -> relax.Expr:
    """Runtime axes (a normalized expression) in ``[-rank, rank)`` made non-negative (others
    stay out of range)."""
    axes = as_int64(axes)
    return relax.op.where(relax.op.less(axes, int64(0)), relax.op.add(axes, int64(rank)), axes)


def axes_mask(bb: relax.BlockBuilder, axes: relax.Expr, length: int,
              rank: int) -> tuple[relax.Expr, relax.Expr]:
    """``(mask, ok)`` of a runtime axes tensor of ``length`` elements over a rank-``rank``
    tensor: ``mask`` (rank,) int64 is 1 at the axes named; ``ok`` (bool scalar) holds when they
    are distinct and in ``[-rank, rank)``."""
    norm = relax.op.reshape(normalized_axes(axes, rank), [1, length])
    every = relax.op.reshape(relax.op.arange(0, rank, 1, "int64"), [rank, 1])
    hits = relax.op.sum(relax.op.astype(relax.op.equal(norm, every), "int64"), axis=[1])
    mask = bb.normalize(relax.op.astype(relax.op.greater(hits, int64(0)), "int64"))
    ok = relax.op.equal(relax.op.sum(mask), int64(length))
    return mask, bb.normalize(ok)


def kept_dims(dims: relax.Expr, mask: relax.Expr, rank: int, kept: int) -> relax.Expr:
    """The entries of ``dims`` (rank,) where ``mask`` (rank,) is 0, in order: (kept,) int64.

    ``pos[k]`` = number of unmasked axes before ``k``; entry ``i`` sums ``dims[k]`` over the
    unmasked ``k`` with ``pos[k] == i`` (one of them). No sort, no scan: r·r elementwise work.
    """
    keep = relax.op.subtract(int64(1), mask)
    before = relax.const(np.tril(np.ones((rank, rank), "int64"), -1), "int64")  # [k, j] = j < k
    pos = relax.op.sum(relax.op.multiply(before, relax.op.reshape(keep, [1, rank])), axis=[1])
    slots = relax.const(np.arange(kept, dtype="int64").reshape(kept, 1), "int64")
    hit = relax.op.astype(relax.op.equal(relax.op.reshape(pos, [1, rank]), slots), "int64")
    picked = relax.op.multiply(relax.op.multiply(hit, relax.op.reshape(keep, [1, rank])),
                               relax.op.reshape(dims, [1, rank]))
    return relax.op.sum(picked, axis=[1])


def checked(bb: relax.BlockBuilder, value: relax.Expr, ok: relax.Expr) -> relax.Expr:
    """``value`` (a tensor of static shape) that makes the call fail unless ``ok`` (a bool scalar
    tensor) holds: ``value`` is cast to the run-time checked dims and back to its static type."""
    value = bb.normalize(value)
    dims = symbolic_dims(bb, dims_tensor(value), value.ty.ndim, "checked", ok)
    loose = bb.match_cast(value, relax.TensorType(dims, str(value.ty.dtype)))
    return bb.match_cast(loose, value.ty)


def scalar(bb: relax.BlockBuilder, value: relax.Expr) -> relax.Expr:
    """A 0-D or 1-element tensor as a 0-D int64 tensor."""
    return bb.normalize(relax.op.reshape(as_int64(value), []))


Fallback = Callable[[list], relax.Expr]
Handler = Callable[[relax.BlockBuilder, list, dict, Fallback], relax.Expr]


def with_runtime_inputs(base: type, indices: tuple[int, ...], handler: Handler) -> type:
    """TVM's converter ``base`` that sends a node to ``handler(bb, inputs, attr, fallback)``
    when one of its ``indices`` inputs is a runtime tensor (constants keep ``base``);
    ``fallback(inputs)`` runs ``base`` on other inputs (constants the handler made)."""

    class RuntimeInputs(base):
        @classmethod
        def get_converter(cls, opset):
            impl = super().get_converter(opset)

            def convert(bb, inputs, attr, params):
                if not any(i < len(inputs) and is_runtime(inputs[i]) for i in indices):
                    return impl(bb, inputs, attr, params)
                node = str(attr.get("tvm_custom", {}).get("name") or "")
                token = _NODE.set(re.sub(r"\W", "_", node) + "_" if node else "")
                try:
                    return handler(bb, list(inputs), attr, lambda new: impl(bb, new, attr, params))
                except ValueError as err:  # the handlers' refusals ("Op: what is not supported")
                    raise UnsupportedOpError("ONNX", [(node or "<unnamed>", str(err))]) from err
                finally:
                    _NODE.reset(token)

            return convert

    RuntimeInputs.__name__ = RuntimeInputs.__qualname__ = base.__name__
    return RuntimeInputs


def axis_window(bb: relax.BlockBuilder, x: relax.Expr, axis: int, start: tirx.PrimExpr,
                length: tirx.PrimExpr) -> relax.Expr:
    """``x[…, start : start + length, …]`` along ``axis``, bounds symbolic (one TE kernel)."""
    from tvm import te

    def window(data: te.Tensor, begin: tirx.PrimExpr, size: tirx.PrimExpr) -> te.Tensor:
        shape = list(data.shape)
        shape[axis] = size
        return te.compute(shape, lambda *i: data(*i[:axis], i[axis] + begin, *i[axis + 1:]),
                          name="window")

    # symbolic values go in as arguments: emit_te passes only those (and shape dims) to the kernel
    return bb.emit_te(window, x, start, length)


def spread(values: relax.Expr, axes: list[int], rank: int, fill: relax.Expr) -> relax.Expr:
    """``values`` (one per entry of ``axes``) spread over ``rank`` axes, ``fill[k]`` elsewhere."""
    index = [axes.index(k) if k in axes else len(axes) + k for k in range(rank)]
    pool = relax.op.concat([values, fill], axis=0)
    return relax.op.take(pool, relax.const(np.array(index, "int64"), "int64"), axis=0)


def prim_sum(values: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """``values[0] + … `` (0 for none), as int64."""
    out: tirx.PrimExpr = tirx.IntImm("int64", 0)
    for v in values:
        out = out + v
    return out
