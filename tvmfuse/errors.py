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
    """Lowering, codegen or nvcc failed; the message names the stage.

    A pipeline stage that fails also names where: the Relax ``function``, the ``binding`` (its var)
    and the ``op`` it applies, with TVM's text as ``detail``::

        stage 'mixed_precision' failed in function 'main' at binding 'lv1' (op
        relax.call_tir(layer_norm_stats), binding #57):
          lv1 = R.call_tir(layer_norm_stats, (lv57,), ...)
          detail: Check failed: (tensor) is false: Expected TensorType, but got R.Callable(...)
    """

    def __init__(self, message: str | None = None, *, stage: str | None = None,
                 function: str | None = None, binding: str | None = None, op: str | None = None,
                 expr: str | None = None, detail: str | None = None, index: int = 0) -> None:
        self.stage, self.function, self.binding, self.op = stage, function, binding, op
        self.expr, self.detail, self.index = expr, detail, index
        if message is None:
            message = f"stage {stage!r} failed"
            if binding:
                nth = f", binding #{index}" if index else ""
                message += f" in function {function!r} at binding {binding!r} (op {op}{nth})"
            elif function:
                message += f" in function {function!r} (op {op})"
            else:
                message += " (not localised to a binding)"
            message += ":"
            if expr:
                message += f"\n  {binding} = {expr}"
            if detail:
                message += f"\n  detail: {detail}"
        super().__init__(message)


class LibraryError(TvmfuseError):
    """An exported library cannot be loaded (missing, corrupt, not a tvmfuse library)."""


class DeviceError(TvmfuseError):
    """No usable device, or the GPU's architecture does not match the library."""


class InputError(TvmfuseError, ValueError):
    """A call's inputs do not match the library's signature (count, name, shape, dtype, device)."""


# What TVM's own calls raise when they refuse an input (tvm_ffi maps C++ errors onto these; TVMError
# is a RuntimeError). A ``try`` around a TVM call catches these, never ``Exception``: a Python bug
# (AttributeError, KeyError, NameError, ...) in tvmfuse must propagate.
TVM_ERRORS: tuple[type[Exception], ...] = (RuntimeError, ValueError, TypeError)
