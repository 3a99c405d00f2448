"""tvmfuse: a kernel-fusion compiler on Apache TVM for NVIDIA GPUs.

    lib = tvmfuse.compile(model, example_inputs, target="sm90", dtype="float16")
    lib.export("model.so")
    model = tvmfuse.load("model.so", device="cuda")
    y = model(x)
"""

from .errors import (
    CompileError,
    DeviceError,
    InputError,
    InputSpecError,
    LibraryError,
    ModelError,
    TvmfuseError,
    UnsupportedOpError,
)
from .runtime import CompiledModel, load
from .version import __version__


def compile(*args, **kwargs):  # noqa: A001
    """See :func:`tvmfuse.compiler.compile` (imported lazily: the runtime needs no compiler)."""
    from .compiler import compile as _compile

    return _compile(*args, **kwargs)


def compile_lm(*args, **kwargs):
    """See :func:`tvmfuse.llm.compile_lm` (imported lazily, like ``compile``)."""
    from .llm import compile_lm as _compile_lm

    return _compile_lm(*args, **kwargs)


def tune(*args, **kwargs):
    """See :func:`tvmfuse.tune.tune`: MetaSchedule over the fused kernels into a database."""
    from .tune import tune as _tune

    return _tune(*args, **kwargs)


__all__ = [
    "CompileError", "CompiledModel", "DeviceError", "InputError", "InputSpecError", "LibraryError",
    "ModelError", "TvmfuseError", "UnsupportedOpError", "__version__", "compile", "compile_lm", "load",
    "tune",
]
