"""Symbolic input dimensions in the imported Relax ``main``: one ``tir.Var`` (int64) per symbol,
named as the user named it, bounded by ``tir_var_lower_bound`` / ``tir_var_upper_bound`` (what TVM's
memory planning reads: buffers are planned for the range's upper end)."""

from __future__ import annotations

import tvm
from tvm import relax

from ..relax_shapes import LOWER_BOUND, UPPER_BOUND
from .spec import Ranges


def symbol_vars(dynamic: Ranges) -> dict[str, tvm.tirx.Var]:
    """One int64 ``tir.Var`` per symbol (shared by every input that uses the symbol)."""
    return {name: tvm.tirx.Var(name, "int64") for name in dynamic}


def bound_symbols(mod: tvm.IRModule, dynamic: Ranges,
                  binding: dict[str, int | str] | None = None) -> tvm.IRModule:
    """``main`` with its symbols bound (``binding``: importer's symbol name → int or user symbol) and
    bounded by ``dynamic``'s ranges. Returns a new module; ``mod`` is not changed."""
    vars_ = symbol_vars(dynamic)
    binding = {old: (vars_[new] if isinstance(new, str) else new)
               for old, new in (binding or {}).items() if new != old}
    if binding:
        mod = relax.transform.BindSymbolicVars(binding)(mod)
    func = mod["main"]
    attrs = dict(func.attrs) if func.attrs is not None else {}
    for key, index in ((LOWER_BOUND, 0), (UPPER_BOUND, 1)):
        bounds = {str(k): int(v) for k, v in dict(attrs.get(key, {})).items() if str(k) not in binding}
        bounds.update({name: rng[index] for name, rng in dynamic.items()})
        if bounds:
            attrs[key] = bounds
    func = func.with_attrs(attrs)
    new = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    new["main"] = func
    return new
