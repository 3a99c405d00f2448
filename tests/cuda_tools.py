"""Skip markers for CPU tests that need the CUDA toolchain (nvcc to build, cuobjdump to read SASS)."""

from __future__ import annotations

import pytest

from tvmfuse.build.inspect import find_cuobjdump
from tvmfuse.build.nvcc import find_nvcc


def has_tool(find) -> bool:
    """True when ``find()`` locates the tool (it returns None or raises when it is missing)."""
    try:
        return find() is not None
    except Exception:  # noqa: BLE001 - CompileError / LibraryError: the tool is missing
        return False


needs_nvcc = pytest.mark.skipif(not (has_tool(find_nvcc) and has_tool(find_cuobjdump)),
                                reason="needs nvcc and cuobjdump")
