"""Weights leave the executable: large constants become trailing parameters of each function.

    f(x_0 … x_{n-1})              uses constants c_0 … c_{m-1} (each ≥ MIN_WEIGHT_BYTES)
 →  f(x_0 … x_{n-1}, w_0 … w_{k-1})   attrs num_input = n, params = [tensor(w_0) … tensor(w_{k-1})]

The constants are the ones the pipeline left after every fold (weights transposed, concatenated for
the fused QKV and gate/up GEMMs, cast to fp16, norm statistics of embedding tables), so the file
holds the fused layout and the kernels are the embedded build's, one for one. Identical constants
(the same node, or equal bytes, dtype and shape) become one parameter; every public Relax function
gets the same ``w_0 … w_{k-1}`` in the same order, so a runtime passes one list to every entry
point. ``num_input`` and ``params`` are TVM's convention (``from_exported_program(...,
keep_params_as_input=True)``, ``relax.frontend.detach_params``); ``RewriteCUDAGraph`` treats the
parameters past ``num_input`` as static, as it treats constants.

Must sit after the last pass that folds or reads constants (``fold_constants``, the schedule
rules) and before the VM lowering (``ToNonDataflow`` … ``VMShapeLower``). ``VMShapeLower`` checks
only the first ``num_input`` parameters, so the weights cost no check per call; the loader checks
them once against the library's metadata. ``min_total_bytes``: lift nothing when the liftable
constants add up to less (``weights="auto"``). :func:`take_weights` removes the ``params``
attributes and returns ``[(name, tensor)]`` in parameter order for the export.
"""

from __future__ import annotations

import re

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant, GenericConst

MIN_WEIGHT_BYTES = 1024  # smaller constants (scalars, small biases, shape tables) stay in the .so
AUTO_EXTERNAL_BYTES = 256 << 20  # weights="auto": external from this many bytes of weights on
WEIGHT_MODES = ("auto", "external", "embedded")
_NAME_CHARS = 64  # "w<i>.<kernel that first reads it>", cut: fused kernel names run long
_SAMPLE = 64  # bytes from each end of a tensor that bucket candidates for the equal-bytes check


def host_array(tensor: tvm.runtime.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as numpy: a view through DLPack where numpy takes the dtype, else a copy
    (bfloat16, float8)."""
    try:
        return np.from_dlpack(tensor)
    except (RuntimeError, BufferError, TypeError):
        return tensor.numpy()


def _nbytes(tensor: tvm.runtime.Tensor) -> int:
    return int(np.prod(tensor.shape, dtype=np.int64)) * tvm.DataType(str(tensor.dtype)).itemsize


class _Weights:
    """The distinct weights met so far, in first-use order, with their parameter names."""

    def __init__(self) -> None:
        self.tensors: list[tvm.runtime.Tensor] = []
        self.names: list[str] = []
        self._by_node: dict[Constant, int] = {}
        self._buckets: dict[tuple, list[int]] = {}

    def index(self, const: Constant, user: str) -> int:
        """The parameter index of ``const`` (a new one unless an equal weight has one)."""
        if const in self._by_node:
            return self._by_node[const]
        tensor = const.value
        arr = host_array(tensor).reshape(-1).view(np.uint8)
        key = (str(tensor.dtype), tuple(tensor.shape), arr[:_SAMPLE].tobytes(), arr[-_SAMPLE:].tobytes())
        bucket = self._buckets.setdefault(key, [])
        for i in bucket:
            if np.array_equal(host_array(self.tensors[i]).reshape(-1).view(np.uint8), arr):
                self._by_node[const] = i
                return i
        i = len(self.tensors)
        bucket.append(i)
        self.tensors.append(tensor)
        self.names.append(self._unique(f"w{i}.{user}"[:_NAME_CHARS]))
        self._by_node[const] = i
        return i

    def _unique(self, name: str) -> str:
        name = re.sub(r"[^A-Za-z0-9_.]", "_", name)
        return name if name not in self.names else f"{name}_{len(self.names)}"


def _large(expr: relax.Expr) -> bool:
    return (isinstance(expr, Constant) and isinstance(expr.value, tvm.runtime.Tensor)
            and _nbytes(expr.value) >= MIN_WEIGHT_BYTES)


def _user_name(call: relax.Call) -> str:
    """The kernel (call_tir callee) or op a binding calls: the weight's name stem."""
    if call.op == tvm.ir.Op.get("relax.call_tir") or isinstance(call.op, tvm.ir.GlobalVar):
        callee = call.args[0] if not isinstance(call.op, tvm.ir.GlobalVar) else call.op
        return callee.name_hint if isinstance(callee, tvm.ir.GlobalVar) else "const"
    return call.op.name.rpartition(".")[2] if isinstance(call.op, tvm.ir.Op) else "const"


def _collect(func: relax.Function, weights: _Weights) -> None:
    """Registers every large constant ``func`` uses, named after the kernel that first reads it."""

    def register(expr: relax.Expr, user: str) -> None:
        relax.analysis.post_order_visit(expr, lambda e: _large(e) and weights.index(e, user))

    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            register(value, _user_name(value) if isinstance(value, relax.Call) else "const")
    register(func.body.body, "const")


@relax.expr_functor.mutator
class _Replace(relax.PyExprMutator):
    """Every registered constant → its parameter var."""

    def __init__(self, mod: tvm.IRModule, weights: _Weights, params: list[relax.Var]) -> None:
        super().__init__(mod)
        self.weights, self.params = weights, params

    def visit_generic_const_(self, op: GenericConst) -> relax.Expr:
        if _large(op):
            return self.params[self.weights.index(op, "const")]
        return op


def _public(func: tvm.ir.BaseFunc) -> bool:
    return isinstance(func, relax.Function) and func.attrs is not None and "global_symbol" in func.attrs


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.LiftWeights")
class LiftWeights:
    """Constants of ≥ ``MIN_WEIGHT_BYTES`` in public Relax functions → shared trailing parameters."""

    def __init__(self, min_total_bytes: int = 0) -> None:
        self.min_total_bytes = min_total_bytes

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        funcs = {gv: f for gv, f in mod.functions.items() if _public(f)}
        weights = _Weights()
        for func in funcs.values():
            _collect(func, weights)
        total = sum(_nbytes(t) for t in weights.tensors)
        if not weights.tensors or total < self.min_total_bytes:
            return mod
        new = mod.clone()  # assigned into below: not the caller's module
        for gv, func in funcs.items():
            params = [relax.Var(name, relax.TensorType(list(t.shape), str(t.dtype)))
                      for name, t in zip(weights.names, weights.tensors)]
            body = _Replace(mod, weights, params).visit_expr(func.body)
            lifted = relax.Function([*func.params, *params], body, func.ret_ty, func.is_pure,
                                    func.attrs, func.span)
            new[gv] = lifted.with_attrs({"num_input": len(func.params), "params": weights.tensors})
        return relax.transform.Normalize()(new)


def lift_threshold(mode: str) -> int | None:
    """``LiftWeights``' ``min_total_bytes`` for a ``weights=`` mode; None: do not lift."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, not {mode!r}")
    return {"external": 0, "auto": AUTO_EXTERNAL_BYTES, "embedded": None}[mode]


def take_weights(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[tuple[str, tvm.runtime.Tensor]]]:
    """``mod`` without the ``params`` attributes, and ``[(name, tensor)]`` in parameter order
    (empty when nothing was lifted). Every function that has them has the same list."""
    found: list[tuple[str, tvm.runtime.Tensor]] | None = None
    out = tvm.IRModule({}, attrs=mod.attrs)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and func.attrs is not None and "params" in func.attrs:
            n = int(func.attrs["num_input"])
            mine = [(p.name, t) for p, t in zip(func.params[n:], func.attrs["params"])]
            if found is not None and [name for name, _ in found] != [name for name, _ in mine]:
                raise ValueError(f"function {gv.name_hint} takes other weights than the first one")
            found = mine
            func = func.without_attr("params")
        out[gv] = func
    return out, found or []
