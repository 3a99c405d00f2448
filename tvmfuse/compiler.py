"""``tvmfuse.compile``: model → Relax → fused, scheduled kernels → Library."""

from __future__ import annotations

import importlib.metadata as md
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .build import export_library
from .errors import InputSpecError
from .frontend import ImportedModel, TensorSpec, dynamic_ranges, import_model, input_overrides
from .options import Options
from .passes.lift_weights import WEIGHT_MODES, take_weights
from .pipeline import build, lower
from .runtime import load
from .targets import TargetSpec, get_target
from .tuning_db import tuning_summary
from .version import __version__


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def _dim(value) -> int | str:
    """A Relax shape dimension: its int, else its expression over the symbols (``S``, ``S * 2``)."""
    try:
        return int(value)
    except TypeError:
        return str(value)


def _output_specs(mod, names: list[str]) -> list[TensorSpec]:
    ret = mod["main"].ret_ty
    fields = list(ret.fields) if hasattr(ret, "fields") else [ret]
    specs = []
    for name, sinfo in zip(names, fields):
        shape = tuple(_dim(d) for d in sinfo.shape.values) if sinfo.shape is not None else ()
        specs.append(TensorSpec(name, shape, str(sinfo.dtype)))
    return specs


@dataclass
class Library:
    """A compiled model: ``export(path)`` writes the ``.so``; ``load()`` runs it in-process."""

    executable: Any  # tvm.relax.VMExecutable
    target: TargetSpec
    model: ImportedModel
    dtype: str | None
    outputs: list[TensorSpec]
    tuning: dict[str, Any] | None = None  # with --tuning-db: the database and its use per kernel
    # external weights: (name, tensor) in the order main takes them after the inputs; [] embedded
    weights: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def metadata(self) -> dict[str, Any]:
        return {
            "format": "tvmfuse-library/1",
            "target": self.target.name,
            "sass": [real for _, real in self.target.gencode],
            "dtype": self.dtype,
            "frontend": self.model.frontend,
            "source": self.model.source,
            "inputs": [s.to_json() for s in self.model.inputs],
            "dynamic": {name: list(rng) for name, rng in self.model.dynamic.items()},
            "outputs": [s.to_json() for s in self.outputs],
            "versions": {"tvmfuse": __version__, "tvm": _version("apache-tvm"),
                         "tvm_ffi": _version("apache-tvm-ffi")},
        } | ({"tuning": self.tuning} if self.tuning else {})

    def export(self, path: str | os.PathLike) -> Path:
        """Write the ``.so`` (fatbin inside for CUDA targets); with external weights also
        ``<name>.safetensors`` beside it, which ``tvmfuse.load`` maps and checks."""
        return export_library(self.executable, path, self.target, self.metadata, weights=self.weights)

    def load(self, device: str | None = None, workdir: str | None = None):
        """Export to a temporary file and load it (``tvmfuse.load``)."""
        workdir = workdir or tempfile.mkdtemp(prefix="tvmfuse-")
        path = self.export(Path(workdir) / "model.so")
        return load(path, device or ("cpu" if not self.target.is_cuda else "cuda"))


def compile(  # noqa: A001 - the public name mirrors torch.compile / tvm.compile
    model: Any,
    example_inputs: tuple | None = None,
    *,
    target: str = "sm90",
    dtype: str | None = None,
    inputs: dict[str, Any] | list[str] | None = None,
    tuning_db: str | os.PathLike | None = None,
    options: Options | None = None,
    dynamic: dict[str, Any] | list[str] | None = None,
    weights: str = "auto",
) -> Library:
    """Compile ``model`` (ONNX path/proto, .pt2 path, ``pkg.mod:factory`` or nn.Module).

    ``dtype``: None/"float32" keeps the model's precision; "float16"/"bfloat16" converts a float32
    model to mixed precision (fp32 accumulation). ``inputs`` fixes dynamic dims:
    ``{"x": (2, 64)}`` or ``["x:2x64"]``, or names them by symbol: ``{"input_ids": "1xS"}``.
    ``dynamic``: each symbol's inclusive range, ``{"S": (1, 4096)}`` or ``["S=1..4096"]``; one
    library then serves every length in the range (ONNX ``dim_param``s named here stay symbolic
    without an ``inputs`` entry). ``tuning_db``: a ``tvmfuse tune`` database; a kernel
    uses its tuned schedule only where that measured faster than the default rule.
    ``options``: the kernels' switches and the device (:class:`tvmfuse.options.Options`).
    ``weights``: "external" writes the weights to ``<name>.safetensors`` beside the exported
    ``.so``, "embedded" keeps them inside it, "auto" is external from 256 MB of weights on
    (``tvmfuse.passes.lift_weights.AUTO_EXTERNAL_BYTES``). The kernels are the same either way.
    """
    spec = get_target(target)
    if dtype not in (None, "float32", "float16", "bfloat16"):
        raise InputSpecError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
    if weights not in WEIGHT_MODES:
        raise InputSpecError(f"weights must be one of {', '.join(WEIGHT_MODES)}, not {weights!r}")
    overrides = input_overrides(inputs)
    imported = import_model(model, example_inputs, overrides, dynamic_ranges(dynamic))
    lowered = lower(imported.mod, spec, dtype if dtype != "float32" else None, tuning_db=tuning_db,
                    options=options, weights=weights)
    lowered, params = take_weights(lowered)
    outputs = _output_specs(imported.mod, imported.output_names)
    executable = build(lowered, spec, options)
    tuning = None
    if tuning_db is not None:
        tuning = tuning_summary(tuning_db, lowered)
    return Library(executable, spec, imported, dtype, outputs, tuning, params)
