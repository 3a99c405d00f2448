"""Errors tvmfuse raises. Each one names what was wrong and where (node, input, file)."""

from __future__ import annotations


class TvmfuseError(Exception):
    """Base class of every error tvmfuse raises on purpose."""


class ModelError(TvmfuseError):
    """The model file or object cannot be read (missing, corrupt, wrong kind)."""


class UnsupportedOpError(ModelError):
    """The graph holds operators no frontend converter handles.

    ``unsupported`` lists every offender as ``(node_name, op_type)``, all of them at once.
    """

    def __init__(self, frontend: str, unsupported: list[tuple[str, str]]):
        self.frontend = frontend
        self.unsupported = unsupported
        ops = sorted({op for _, op in unsupported})
        lines = [f"  node {name!r}: op {op}" for name, op in unsupported]
        super().__init__(
            f"{frontend} model has {len(unsupported)} node(s) with unsupported operators "
            f"({', '.join(ops)}):\n" + "\n".join(lines)
        )


class InputSpecError(TvmfuseError):
    """An --input override or a model input shape is wrong or missing."""


class CompileError(TvmfuseError):
    """Lowering, codegen or nvcc failed; the message names the stage."""


class LibraryError(TvmfuseError):
    """An exported library cannot be loaded (missing, corrupt, not a tvmfuse library)."""


class DeviceError(TvmfuseError):
    """No usable device, or the GPU's architecture does not match the library."""


class InputError(TvmfuseError, ValueError):
    """A call's inputs do not match the library's signature (count, name, shape, dtype, device)."""
