"""What TVM needs set up before tvmfuse's kernels are built, done explicitly and once.

* :func:`register_tvm_patches` — idempotent, thread-safe: the sm_80 GEMM's two TIR pipeline
  fixes (``LowerWarpMemory`` lowering every warp buffer, one barrier per K tile after
  ``ThreadSync``; ``schedules/gemm_sm80.py``) and the hybrid s_tir / tirx TIR pipeline of the
  sm_90a kernels (``schedules/gemm_sm90.py``), and an s_tir pipeline; both insert the
  programmatic-launch wait into kernels that ask for it (``rules/programmatic_launch.py``).
  Importing a kernel module patches nothing; the pipeline (``pipeline.lower`` and
  ``pipeline.build``), ``tvmfuse tune``'s builders and scripts that build kernels themselves
  call this.
* The TVMScript parser gets a light ``inspect.stack`` (``tvmscript_frames.py``): the generated
  kernels (2.4x) and TVM's tensor intrinsics (13x) parse faster, to the same functions.
* :func:`cuda_source_only` — ``TVM_COMPILE_FORCE_FALLBACK=1`` for the duration of a build, so that
  CUDA code stays source (export runs nvcc) whether or not a GPU driver is present. TVM's C++
  codegen reads the variable from the process environment, so it cannot be scoped to one thread:
  a lock and a count of builds in flight set it when the first build enters and restore the
  caller's value when the last one leaves, so concurrent builds never see it unset.
* :func:`codegen_scope` — both of the above plus the TIR build options of the sm_80 GEMM
  (``BUILD_CONFIG``) and the caller's :class:`~tvmfuse.options.Options`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import tvm

from .options import Options, use_options
from .rules.gemm_sm80 import BUILD_CONFIG, patch_lower_warp_memory, patch_thread_sync
from .rules.gemm_sm90 import HYBRID_PIPELINE, hybrid_pipeline
from .rules.programmatic_launch import with_device_wait
from .tvmscript_frames import install as _fast_tvmscript

S_TIR_PIPELINE = "tvmfuse_s_tir"  # TVM's s_tir pipeline + the PDL wait in each kernel that asks
_FALLBACK_ENV = "TVM_COMPILE_FORCE_FALLBACK"
_lock = threading.Lock()
_registered = False
_builds = 0  # builds inside cuda_source_only, all threads
_saved: str | None = None  # the caller's value of the variable before the first of them


def register_tvm_patches() -> None:
    """Install tvmfuse's TVM pipeline patches and its hybrid TIR pipeline (once per process)."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return

        _fast_tvmscript()  # TVMScript kernels parse 2.4x faster (tvmscript_frames.py)
        patch_lower_warp_memory()
        patch_thread_sync()
        # both TIR pipelines insert griddepcontrol.wait into kernels launched programmatically
        tvm.tirx.register_tir_pipeline(HYBRID_PIPELINE, with_device_wait(hybrid_pipeline))
        tvm.tirx.register_tir_pipeline(
            S_TIR_PIPELINE, with_device_wait(lambda: tvm.tirx.get_tir_pipeline("s_tir")))
        _registered = True


@contextmanager
def cuda_source_only() -> Iterator[None]:
    """``TVM_COMPILE_FORCE_FALLBACK=1`` while any thread is inside (see the module docstring)."""
    global _builds, _saved
    with _lock:
        if _builds == 0:
            _saved = os.environ.get(_FALLBACK_ENV)
            os.environ[_FALLBACK_ENV] = "1"
        _builds += 1
    try:
        yield
    finally:
        with _lock:
            _builds -= 1
            if _builds == 0:  # leave the caller's environment as it was
                if _saved is None:
                    os.environ.pop(_FALLBACK_ENV, None)
                else:
                    os.environ[_FALLBACK_ENV] = _saved


@contextmanager
def codegen_scope(options: Options | None = None) -> Iterator[None]:
    """Patches registered, CUDA kept as source, the sm_80 GEMM's TIR build options, ``options``."""

    register_tvm_patches()
    with use_options(options), cuda_source_only(), tvm.transform.PassContext(config=BUILD_CONFIG):
        yield
