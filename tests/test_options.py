"""Options as a scoped value (tvmfuse/options.py) and TVM's set-up done explicitly
(tvmfuse/tvm_setup.py): patches registered once and not on import, the CUDA-source
environment switch safe across threads."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading

import pytest

from tvmfuse.errors import InputSpecError
from tvmfuse.options import Options, current_options, use_options
from tvmfuse.tvm_setup import cuda_source_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_scopes_nest_and_restore():
    assert current_options() == Options()
    with use_options(Options(sm80_c_row_pad=0)):
        assert current_options().sm80_c_row_pad == 0
        with use_options(Options(elementwise_variant="v1")):
            assert current_options() == Options(elementwise_variant="v1")
        with use_options(None):  # None keeps the options in effect
            assert current_options().sm80_c_row_pad == 0
        assert current_options().sm80_c_row_pad == 0
    assert current_options() == Options()


def test_threads_see_their_own_options():
    barrier, seen = threading.Barrier(2), {}

    def compile_with(pad: int) -> None:
        with use_options(Options(sm80_c_row_pad=pad)):
            barrier.wait()  # both scopes are open at once
            seen[pad] = current_options().sm80_c_row_pad

    threads = [threading.Thread(target=compile_with, args=(p,)) for p in (0, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {0: 0, 4: 4}


def test_cuda_source_only_counts_threads(monkeypatch):
    """The variable stays set while any build is inside, and the caller's value comes back."""
    monkeypatch.setenv("TVM_COMPILE_FORCE_FALLBACK", "users-value")
    inside, leave, values = threading.Event(), threading.Event(), []

    def long_build() -> None:
        with cuda_source_only():
            inside.set()
            leave.wait()

    t = threading.Thread(target=long_build)
    t.start()
    inside.wait()
    with cuda_source_only():
        values.append(os.environ["TVM_COMPILE_FORCE_FALLBACK"])
    values.append(os.environ["TVM_COMPILE_FORCE_FALLBACK"])  # the other build is still inside
    leave.set()
    t.join()
    assert values == ["1", "1"]
    assert os.environ["TVM_COMPILE_FORCE_FALLBACK"] == "users-value"


def test_patches_are_explicit_and_idempotent():
    """Importing the kernels patches nothing; register_tvm_patches does, once (fresh process)."""
    code = """
from tvm import s_tir, tirx
warp, sync = tirx.transform.LowerWarpMemory, s_tir.transform.ThreadSync
import tvmfuse.pipeline, tvmfuse.rules.gemm_sm80, tvmfuse.rules.gemm_sm90
from tvm.tirx.compilation_pipeline import PIPELINE_MAP
assert tirx.transform.LowerWarpMemory is warp and s_tir.transform.ThreadSync is sync
assert "tvmfuse_hybrid" not in PIPELINE_MAP
from tvmfuse.tvm_setup import register_tvm_patches
register_tvm_patches()
patched = tirx.transform.LowerWarpMemory, s_tir.transform.ThreadSync
assert patched[0] is not warp and patched[1] is not sync and "tvmfuse_hybrid" in PIPELINE_MAP
register_tvm_patches()
assert (tirx.transform.LowerWarpMemory, s_tir.transform.ThreadSync) == patched
"""
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_options_reject_a_wrongly_typed_switch():
    with pytest.raises(InputSpecError, match="sm90_vector_operands must be bool"):
        Options(sm90_vector_operands="False")
    with pytest.raises(InputSpecError, match="gemv_max_m must be int"):
        dataclasses.replace(Options(), gemv_max_m="64")
    assert Options(programmatic_launch="all", device="h200").device == "h200"


def test_options_reject_a_negative_head_count():
    with pytest.raises(InputSpecError, match="decode_attention_heads must be 0 .* not -2"):
        Options(decode_attention_heads=-2)
    assert Options(decode_attention_heads=2).decode_attention_heads == 2
