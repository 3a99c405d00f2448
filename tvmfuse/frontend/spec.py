"""Input/output signatures and ``--input NAME:SHAPE[:DTYPE]`` overrides."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import InputSpecError

_DTYPES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint64",
           "uint32", "uint16", "uint8", "bool"}


@dataclass(frozen=True)
class TensorSpec:
    """Name, static shape and dtype of one model input or output."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass(frozen=True)
class InputOverride:
    """A user-fixed shape (and optionally dtype) for one input."""

    shape: tuple[int, ...]
    dtype: str | None = None


def parse_input_override(text: str) -> tuple[str, InputOverride]:
    """Parse ``NAME:SHAPE[:DTYPE]`` with SHAPE like ``2x64`` (``x``-separated ints)."""
    parts = text.rsplit(":", 2) if text.count(":") >= 2 else text.split(":")
    if len(parts) < 2 or not parts[0]:
        raise InputSpecError(f"--input {text!r}: expected NAME:SHAPE[:DTYPE], e.g. x:2x64:float32")
    name, shape_text = parts[0], parts[1]
    dtype = parts[2] if len(parts) == 3 else None
    if not re.fullmatch(r"\d+(x\d+)*", shape_text):
        raise InputSpecError(
            f"--input {text!r}: shape {shape_text!r} must be positive integers joined by 'x'"
        )
    shape = tuple(int(s) for s in shape_text.split("x"))
    if any(s <= 0 for s in shape):
        raise InputSpecError(f"--input {text!r}: every dimension must be positive")
    if dtype is not None and dtype not in _DTYPES:
        raise InputSpecError(f"--input {text!r}: unknown dtype {dtype!r}")
    return name, InputOverride(shape, dtype)


@dataclass
class ImportedModel:
    """A model imported into Relax: ``mod['main']`` takes ``inputs`` and returns ``outputs``."""

    mod: Any  # tvm.IRModule
    inputs: list[TensorSpec]
    output_names: list[str]
    frontend: str  # "onnx" or "torch"
    source: str  # path or description, for messages
    reference: Any = field(default=None, repr=False)  # callable(np arrays) -> list[np arrays]


def check_override_names(
    overrides: dict[str, InputOverride], names: list[str], source: str
) -> None:
    """Every ``--input`` must name a real model input."""
    unknown = [n for n in overrides if n not in names]
    if unknown:
        raise InputSpecError(
            f"{source}: --input names {unknown} are not model inputs; the inputs are {names}"
        )


def input_overrides(inputs: dict[str, Any] | list[str] | None) -> dict[str, InputOverride]:
    """``compile(inputs=...)``: ``{"x": (2, 64)}``, ``{"x": "2x64"}`` or ``["x:2x64"]`` → overrides."""
    if not inputs:
        return {}
    if isinstance(inputs, dict):
        result = {}
        for name, value in inputs.items():
            if isinstance(value, InputOverride):
                result[name] = value
            elif isinstance(value, str):
                result[name] = parse_input_override(f"{name}:{value}")[1]
            else:
                result[name] = InputOverride(tuple(int(v) for v in value))
        return result
    return dict(parse_input_override(t) for t in inputs)
