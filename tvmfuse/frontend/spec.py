"""Input/output signatures, ``--input NAME:SHAPE[:DTYPE]`` overrides and ``--dynamic S=LO..HI`` ranges.

A dimension is an int or a symbol name (``1xS``); every symbol has an inclusive range ``(lo, hi)``
and means the same length wherever it appears.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import InputSpecError

_DTYPES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint64",
           "uint32", "uint16", "uint8", "bool"}
_SYMBOL = r"[A-Za-z_][A-Za-z0-9_]*"

Dim = int | str  # a static length or a symbol name
Ranges = dict[str, tuple[int, int]]  # symbol -> inclusive (lo, hi)


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape (ints and symbol names) and dtype of one model input or output."""

    name: str
    shape: tuple[Dim, ...]
    dtype: str

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @property
    def symbols(self) -> list[str]:
        return [d for d in self.shape if isinstance(d, str)]


@dataclass(frozen=True)
class InputOverride:
    """A user-fixed shape (ints, or symbol names for dynamic dims) and optionally dtype."""

    shape: tuple[Dim, ...]
    dtype: str | None = None


def parse_input_override(text: str) -> tuple[str, InputOverride]:
    """Parse ``NAME:SHAPE[:DTYPE]``; SHAPE is dims joined by ``x`` (``2x64``, ``1xS``) or by ``,``
    (``1,max_len``: for symbol names that hold an ``x``). A dim is a positive int or a symbol."""
    parts = text.rsplit(":", 2) if text.count(":") >= 2 else text.split(":")
    if len(parts) < 2 or not parts[0]:
        raise InputSpecError(f"--input {text!r}: expected NAME:SHAPE[:DTYPE], e.g. x:2x64:float32")
    name, shape_text = parts[0], parts[1]
    dtype = parts[2] if len(parts) == 3 else None
    tokens = shape_text.split("," if "," in shape_text else "x")
    if not all(re.fullmatch(rf"\d+|{_SYMBOL}", t) for t in tokens):
        raise InputSpecError(
            f"--input {text!r}: shape {shape_text!r} must be positive integers or symbol names "
            "joined by 'x' (e.g. 2x64 or 1xS)"
        )
    shape = tuple(int(t) if t.isdigit() else t for t in tokens)
    if any(isinstance(s, int) and s <= 0 for s in shape):
        raise InputSpecError(f"--input {text!r}: every dimension must be positive")
    if dtype is not None and dtype not in _DTYPES:
        raise InputSpecError(f"--input {text!r}: unknown dtype {dtype!r}")
    return name, InputOverride(shape, dtype)


def parse_dynamic(text: str) -> tuple[str, tuple[int, int]]:
    """Parse ``S=LO..HI`` (inclusive, 1 <= LO <= HI)."""
    m = re.fullmatch(rf"\s*({_SYMBOL})\s*=\s*(\d+)\s*\.\.\s*(\d+)\s*", text)
    if m is None:
        raise InputSpecError(f"--dynamic {text!r}: expected SYMBOL=LO..HI, e.g. S=1..4096")
    return m.group(1), _check_range(m.group(1), (int(m.group(2)), int(m.group(3))))


def _check_range(name: str, rng: Any) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in rng)
    except (TypeError, ValueError) as err:
        raise InputSpecError(f"dynamic {name!r}: expected a (lo, hi) pair, got {rng!r}") from err
    if not 1 <= lo <= hi:
        raise InputSpecError(f"dynamic {name!r}: range {lo}..{hi} must satisfy 1 <= lo <= hi")
    return lo, hi


def dynamic_ranges(dynamic: dict[str, Any] | list[str] | None) -> Ranges:
    """``compile(dynamic=...)``: ``{"S": (1, 4096)}``, ``{"S": "1..4096"}`` or ``["S=1..4096"]``."""
    if not dynamic:
        return {}
    if isinstance(dynamic, dict):
        return {name: parse_dynamic(f"{name}={rng}")[1] if isinstance(rng, str)
                else _check_range(name, rng) for name, rng in dynamic.items()}
    return dict(parse_dynamic(t) for t in dynamic)


def check_symbols(specs: list[TensorSpec], dynamic: Ranges, source: str) -> None:
    """Every symbol in the inputs has a range, and every range names a symbol of the inputs."""
    used = {s for spec in specs for s in spec.symbols}
    missing = sorted(used - set(dynamic))
    if missing:
        where = {s: [spec.name for spec in specs if s in spec.symbols] for s in missing}
        raise InputSpecError(
            f"{source}: dynamic dimension(s) {missing} (in inputs {where}) have no range; give "
            + " ".join(f"--dynamic {s}=LO..HI" for s in missing) + " or fix them with --input"
        )
    unused = sorted(set(dynamic) - used)
    if unused:
        shapes = {spec.name: list(spec.shape) for spec in specs}
        raise InputSpecError(
            f"{source}: --dynamic names {unused}, which no input dimension uses (input shapes "
            f"{shapes}); name the dimension in --input, e.g. --input NAME:1x{unused[0]}"
        )


@dataclass
class ImportedModel:
    """A model imported into Relax: ``mod['main']`` takes ``inputs`` and returns ``outputs``.

    ``dynamic``: the symbols of ``inputs``' shapes and their inclusive ranges (empty: static).
    """

    mod: Any  # tvm.IRModule
    inputs: list[TensorSpec]
    output_names: list[str]
    frontend: str  # "onnx" or "torch"
    source: str  # path or description, for messages
    reference: Any = field(default=None, repr=False)  # callable(np arrays) -> list[np arrays]
    dynamic: Ranges = field(default_factory=dict)


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
    """``compile(inputs=...)``: ``{"x": (2, 64)}``, ``{"x": "1xS"}`` or ``["x:2x64"]`` → overrides."""
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
                result[name] = InputOverride(tuple(v if isinstance(v, str) else int(v) for v in value))
        return result
    return dict(parse_input_override(t) for t in inputs)
