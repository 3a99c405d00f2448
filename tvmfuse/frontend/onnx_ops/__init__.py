"""ONNX converters tvmfuse adds to or replaces in TVM 0.27's ``from_onnx``, one op per file.

:data:`OVERRIDES` maps op type → converter class; ``onnx_fixes.converters()`` installs them.
"""

from __future__ import annotations

from .layer_norm import LayerNormalization

OVERRIDES: dict[str, type] = {"LayerNormalization": LayerNormalization}

__all__ = ["OVERRIDES"]
