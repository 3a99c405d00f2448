"""Shape-like ONNX inputs that tvmfuse still takes only as constants.

``SplitToSequence`` ``split``, ``DFT`` ``dft_length``: their converters assert (or raise a bare
``ValueError``) when one is a runtime tensor. :func:`runtime_refusals` names each
such input before the converter runs, so the user learns which input to make an initializer (or
a ``Constant``). A constant, or a ``Shape``-derived shape value, is accepted: the node loop folds
constant subgraphs first (``onnx_nodes.fold_node``). The other shape-like inputs (``Reduce*``
axes, ``Reshape`` shape, ``Resize`` scales / sizes, ``Pad``, ``TopK`` K, ``Split``, ``OneHot``
depth, ``CumSum`` / ``CumProd`` / ``DFT`` axis, ``AffineGrid`` size, ``Range``) are converted at
run time: ``onnx_ops.RUNTIME_INPUTS`` (and ``ConstantOfShape``'s own converter).
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

# op → indices of the inputs its 0.27 converter needs as constants
STATIC_INPUTS: dict[str, tuple[int, ...]] = {"DFT": (1,), "SplitToSequence": (1,)}


def _static(value: Any) -> bool:
    return isinstance(value, tvm.ir.GenericConst | relax.ShapeExpr) or (
        isinstance(value, relax.Expr) and isinstance(value.ty, relax.ShapeType))


def _input_name(op: str, index: int, opset: int) -> str:
    from onnx import defs

    try:
        formal = defs.get_schema(op, opset).inputs
    except defs.SchemaError:
        return f"#{index}"
    return formal[index].name if index < len(formal) else f"#{index}"


def runtime_refusals(node, nodes: dict[str, Any], opset: int) -> list[str]:
    """``"Op input NAME ('tensor') ..."`` for each of ``node``'s inputs in :data:`STATIC_INPUTS`
    that is a runtime tensor (no constant, no shape value) in ``nodes`` (the importer's values)."""
    found = []
    for index in STATIC_INPUTS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ():
        if index >= len(node.input) or not node.input[index]:
            continue
        tensor = node.input[index]
        if not _static(nodes.get(tensor)):
            found.append(f"{node.op_type} input {_input_name(node.op_type, index, opset)} "
                         f"({tensor!r}) is a runtime tensor; tvmfuse needs it constant "
                         "(an initializer or a Constant)")
    return found
