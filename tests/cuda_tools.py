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


def check_vs_float64(module, inputs, target: str, tmp_path, tol: float) -> float:
    """GPU: ``module`` through tvmfuse.compile → export → load on ``target`` against its float64
    torch run on the same inputs; asserts rel err ≤ ``tol`` and returns it."""
    import torch

    import tvmfuse
    from tests.conftest import rel_err

    lib = tvmfuse.compile(module, inputs, target=target)
    run = tvmfuse.load(lib.export(tmp_path / "m.so"), device="cuda")
    out = run(*(x.cuda() for x in inputs))
    with torch.no_grad():
        ref = module.double()(*(x.double() for x in inputs))
    err = rel_err(out, ref)
    print(f"rel_err {err:.2e}")
    assert err <= tol
    return err
