"""Op / attribute combinations TVM 0.27's converters ignore and answer wrongly: refused at import.

Each entry names the attribute and why; :func:`refusals` turns a graph's offenders into the
``(node, what)`` pairs :class:`~tvmfuse.errors.UnsupportedOpError` reports, before conversion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# op → [(attribute, accepted(value), why)] ; an absent attribute is always accepted
_ATTRIBUTES: dict[str, list[tuple[str, Callable[[Any], bool], str]]] = {
    "BatchNormalization": [("training_mode", lambda v: v == 0, "training statistics")],
    "ConvTranspose": [("output_shape", lambda v: False, "output_shape is ignored by the converter")],
    "RoiAlign": [("mode", lambda v: v in (b"avg", "avg"), "only mode=avg")],
    "SpaceToDepth": [("mode", lambda v: v in (b"DCR", "DCR"), "only the DCR ordering")],
}
# ops whose converter answers wrongly whatever the attributes
_OPS = {"NonMaxSuppression": "its data-dependent output comes back empty in TVM 0.27"}


def refusals(graph) -> list[tuple[str, str]]:
    """``(node, "Op attribute a=v (why)")`` for every node of ``graph`` refused here."""
    from onnx import helper

    found = []
    for i, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        label = node.name or (node.output[0] if node.output else f"node#{i}")
        if node.op_type in _OPS:
            found.append((label, f"{node.op_type} ({_OPS[node.op_type]})"))
        for attr in node.attribute:
            for name, accepted, why in _ATTRIBUTES.get(node.op_type, ()):
                value = helper.get_attribute_value(attr)
                if attr.name == name and not accepted(value):
                    found.append((label, f"{node.op_type} attribute {name}={value!r} ({why})"))
    return found
