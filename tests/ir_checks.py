"""IR checks shared by the attention tests and the pattern corpus."""

from __future__ import annotations

import re

import tvm
from tvm import relax

_ALLOC = re.compile(r"(?:alloc_buffer|T\.allocate|decl_buffer)\(\(([^()]*(?:\([^()]*\)[^()]*)*)\)")


def _sxs(shape, s: int) -> bool:
    dims = [int(d) for d in shape]
    return dims.count(s) >= 2 or any(d % (s * s) == 0 and d >= s * s for d in dims)


def _two_s_dims(shape, s: int) -> bool:
    """Relax tensors keep their dims: S×S scores show as two S dims (flat byte-sized storages
    and packed attention operands, B·S·H·D·k elements, are multiples of S² by coincidence)."""
    return [int(d) for d in shape].count(s) >= 2


def sxs_tensors(mod: tvm.IRModule, s: int) -> list[str]:
    """Every Relax tensor and every TIR buffer allocation of ``mod`` with S×S elements."""
    found: list[str] = []
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            def visit(e, name=gv.name_hint):
                ty = getattr(e, "ty", None) if isinstance(e, (relax.Var, relax.Call)) else None
                if isinstance(ty, relax.TensorType) and ty.shape is not None:
                    try:
                        if _two_s_dims(ty.shape.values, s):
                            found.append(f"{name}: {e.name if isinstance(e, relax.Var) else e.op} {ty}")
                    except TypeError:
                        pass
                if isinstance(e, relax.ShapeExpr) and _two_s_dims(e.values, s):
                    found.append(f"{name}: shape {e}")

            relax.analysis.post_order_visit(func, visit)
        elif isinstance(func, tvm.tirx.PrimFunc):  # buffers a kernel allocates for itself
            for shape in _ALLOC.findall(func.script()):
                dims = [int(d) for d in re.findall(r"(?:T\.int\d+\()?(\d+)\)?", shape)]
                if _sxs(dims, s):
                    found.append(f"{gv.name_hint}: TIR buffer {dims}")
    return found
