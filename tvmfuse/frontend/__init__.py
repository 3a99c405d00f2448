"""Frontends: ONNX and PyTorch (torch.export) models into Relax.

Every frontend scans the whole graph first and reports *all* unsupported operators at once
(:class:`~tvmfuse.errors.UnsupportedOpError`), then converts with TVM's importer.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ModelError
from .onnx_import import import_onnx
from .spec import (
    ImportedModel,
    InputOverride,
    Ranges,
    TensorSpec,
    dynamic_ranges,
    input_overrides,
    parse_dynamic,
    parse_input_override,
)
from .torch_import import import_exported, import_factory, import_module, import_pt2

__all__ = ["ImportedModel", "InputOverride", "Ranges", "TensorSpec", "dynamic_ranges", "import_model",
           "input_overrides", "parse_dynamic", "parse_input_override"]


def import_model(
    model: Any,
    example_inputs: tuple | None = None,
    overrides: dict[str, InputOverride] | None = None,
    dynamic: Ranges | None = None,
) -> ImportedModel:
    """Import ``model`` into Relax.

    ``overrides`` fix input shapes or name dimensions by symbol (``{"ids": InputOverride((1, "S"))}``,
    see :func:`input_overrides`); ``dynamic`` gives each symbol its inclusive range
    (``{"S": (1, 4096)}``, see :func:`dynamic_ranges`). A symbol stays a bounded ``tir.Var`` in
    ``main`` (``tir_var_lower_bound`` / ``tir_var_upper_bound``). ONNX ``dim_param``s named in
    ``dynamic`` stay symbolic without an override; torch symbols are named through ``overrides``.

    ``model`` is an ``.onnx`` path or ``onnx.ModelProto``, a ``.pt2`` path, a
    ``package.module:factory`` string whose factory returns ``(nn.Module, example_inputs)``, or a
    ``torch.nn.Module`` (with ``example_inputs``).
    """
    overrides = overrides or {}
    dynamic = dynamic or {}
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if path.endswith(".onnx"):
            return import_onnx(path, overrides, dynamic)
        if path.endswith(".pt2"):
            return import_pt2(path, overrides, dynamic)
        if ":" in path and not os.path.exists(path):
            return import_factory(path, overrides, dynamic)
        raise ModelError(
            f"cannot tell the model format of {path!r}: expected a .onnx file, a .pt2 file "
            "(torch.export.save) or package.module:factory"
        )
    type_name = type(model).__module__ + "." + type(model).__name__
    if type_name.startswith("onnx") and hasattr(model, "graph"):
        return import_onnx(model, overrides, dynamic)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional
        torch = None
    if torch is not None and isinstance(model, torch.nn.Module):
        if example_inputs is None:
            raise ModelError("a torch.nn.Module needs example_inputs (a tuple of tensors)")
        return import_module(model, tuple(example_inputs), overrides, dynamic=dynamic)
    if torch is not None and isinstance(model, torch.export.ExportedProgram):
        return import_exported(model, overrides, source="ExportedProgram", dynamic=dynamic)
    raise ModelError(f"unsupported model object of type {type_name}")
