"""Op / attribute combinations TVM 0.27's converters ignore and answer wrongly: refused at import.

Each entry names the attribute (or input) and why; :func:`refusals` turns a graph's offenders into
the ``(node, what)`` pairs :class:`~tvmfuse.errors.UnsupportedOpError` reports, before conversion.
A converter that finds a form it cannot do right only while converting (it needs the input
shapes) refuses it with :func:`refuse`, naming the node the same way.

* ``Cast`` to an 8-bit float or a 4-/2-bit integer: 0.27 rounds fp8 without ONNX's saturation
  and NaN rules (wrong answers) and cannot allocate sub-byte tensors (a crash in the VM).
* ``Dropout`` in training mode: its output is random. ``training_mode`` must be absent or a
  constant false (or ``ratio`` a constant 0, where training changes nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from ...errors import UnsupportedOpError

# op → [(attribute, accepted(value), why)] ; an absent attribute is always accepted
_ATTRIBUTES: dict[str, list[tuple[str, Callable[[Any], bool], str]]] = {
}
# Cast targets 0.27 gets wrong: TensorProto FLOAT8E4M3FN … FLOAT4E2M1, FLOAT8E8M0, UINT2, INT2
_CAST_TARGETS = {17, 18, 19, 20, 21, 22, 23, 24, 25, 26}
_ATTRIBUTES["Cast"] = [("to", lambda v: v not in _CAST_TARGETS,
                        "fp8 / fp4 / int4 / int2 casts are not supported")]
# ops whose converter answers wrongly whatever the attributes
_OPS: dict[str, str] = {}


def _type_name(elem_type: int) -> str:
    from onnx import TensorProto

    return TensorProto.DataType.Name(elem_type)


def _constants(graph) -> dict[str, Any]:
    """Initializers and ``Constant`` node outputs of ``graph``, as numpy arrays."""
    from onnx import numpy_helper

    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output and node.attribute and \
                node.attribute[0].HasField("t"):
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def _training_dropout(node, constants: dict[str, Any]) -> str | None:
    """Why ``node`` (a Dropout) may run in training mode, or None."""
    if node.op_type != "Dropout" or len(node.input) < 3 or not node.input[2]:
        return None
    ratio = constants.get(node.input[1]) if node.input[1] else None
    if ratio is not None and float(ratio) == 0.0:
        return None
    mode = constants.get(node.input[2])
    if mode is not None and not bool(mode):
        return None
    what = "a runtime tensor" if mode is None else "true"
    return (f"Dropout input training_mode ({node.input[2]!r}) is {what}: training-mode Dropout "
            "has a random output (export the model in eval mode)")


def refusals(graph) -> list[tuple[str, str]]:
    """``(node, "Op attribute a=v (why)")`` for every node of ``graph`` refused here."""
    from onnx import helper

    found = []
    constants = _constants(graph)
    for i, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        label = node.name or (node.output[0] if node.output else f"node#{i}")
        if node.op_type in _OPS:
            found.append((label, f"{node.op_type} ({_OPS[node.op_type]})"))
        training = _training_dropout(node, constants)
        if training:
            found.append((label, training))
        for attr in node.attribute:
            for name, accepted, why in _ATTRIBUTES.get(node.op_type, ()):
                value = helper.get_attribute_value(attr)
                if attr.name == name and not accepted(value):
                    value = _type_name(value) if name == "to" else value
                    found.append((label, f"{node.op_type} attribute {name}={value!r} ({why})"))
    return found


def refuse(attr: dict[str, Any], what: str) -> NoReturn:
    """Raise :class:`UnsupportedOpError` for the node a converter is converting (``attr`` is the
    converter's attribute dict; its ``tvm_custom`` names the node): ``what`` says op and why."""
    raise UnsupportedOpError("ONNX", [(attr["tvm_custom"]["name"] or "<unnamed>", what)])
