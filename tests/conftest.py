"""Shared fixtures. ``gpu`` tests run only where torch sees a CUDA device."""

from __future__ import annotations

import os
import sys

import pytest

# An exception inside a schedule rule is a bug: fail the test instead of recording a fallback.
os.environ.setdefault("TVMFUSE_STRICT", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # makes `models` importable wherever pytest starts


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run tools/device/run_gpu.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64."""
    import numpy as np

    out = np.asarray(out.float().cpu() if hasattr(out, "cpu") else out, dtype=np.float64)
    ref = np.asarray(ref.float().cpu() if hasattr(ref, "cpu") else ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
