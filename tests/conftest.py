"""Shared fixtures. ``gpu`` tests run only where torch sees a CUDA device; in the pass tests
(``test_pass_*.py``) a module pass that writes into its input module fails the test."""

from __future__ import annotations

import os
import sys

import pytest
import tvm
import tvm_ffi

from tvmfuse import tvmscript_frames

# An exception inside a schedule rule is a bug: fail the test instead of recording a fallback.
os.environ.setdefault("TVMFUSE_STRICT", "1")
# as pipeline.lower does (tvm_setup.register_tvm_patches), also for tests that build kernels
# themselves: TVMScript parses faster, to the same functions (test_tvmscript_frames.py)
tvmscript_frames.install()

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


# TVM's own passes that write into their input module (tvm 0.27). TVM's
# ``testing.immutable_module`` option cannot exempt them, so the check below is that option with
# these names left out.
TVM_PASSES_THAT_WRITE_THEIR_INPUT = {
    # s_tir/dlight/base/transform.py assigns ``mod[g_var] = func``: the pipeline's "schedule"
    # stage rewrites the module the stage before it handed to ``on_stage``
    "ApplyDefaultSchedule": "dlight",
    # inside FoldConstant's build of a constant subgraph, on a module nothing else reads
    "tirx.AnnotateEntryFunc": "FoldConstant's internal build",
}


@tvm.instrument.pass_instrument
class ImmutableInputs:
    """Records every pass (at any nesting depth) whose input module's structural hash changed
    while it ran, as ``PassContext(config={"testing.immutable_module": True})`` checks. Records,
    does not raise: a pass that catches errors from the passes it runs (FoldConstant does)
    would swallow the failure and silently take another path."""

    def __init__(self) -> None:
        self.running: list[tuple[str, tvm.IRModule, int]] = []
        self.wrote: list[str] = []

    def run_before_pass(self, mod: tvm.IRModule, info: tvm.transform.PassInfo) -> None:
        if info.name not in TVM_PASSES_THAT_WRITE_THEIR_INPUT:
            self.running.append((info.name, mod, tvm_ffi.structural_hash(mod)))

    def run_after_pass(self, _out: tvm.IRModule, info: tvm.transform.PassInfo) -> None:
        while self.running:  # entries above ours: passes that raised inside it
            name, mod, before = self.running.pop()
            if name == info.name:
                if tvm_ffi.structural_hash(mod) != before:
                    self.wrote.append(name)
                return


@pytest.fixture(autouse=True)
def immutable_pass_inputs(request):
    """In ``test_pass_*.py``: every pass the test runs, directly or through the pipeline, leaves
    its input module as it was (a pass that assigns ``mod[gv] = f`` into the caller's module
    turns the caller's "left unchanged" and Before-vs-after numerics checks into comparisons
    of the rewritten module with itself)."""
    if not request.module.__name__.rpartition(".")[2].startswith("test_pass_"):
        yield
        return
    check = ImmutableInputs()
    with tvm.transform.PassContext(instruments=[check]):
        yield
    assert not check.wrote, f"passes wrote into their input module (copy before writing): {check.wrote}"


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64."""
    import numpy as np

    out = np.asarray(out.float().cpu() if hasattr(out, "cpu") else out, dtype=np.float64)
    ref = np.asarray(ref.float().cpu() if hasattr(ref, "cpu") else ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
