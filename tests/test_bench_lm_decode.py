"""``bench_lm_decode.step_increments``: a decode step's span split into each kernel's increment
(its end − the previous kernel's end), averaged over the whole steps between greedy ``advance``
kernels; steps with a stray event (another count) are left out and reported."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools", "bench"))
pytest.importorskip("torch")
import bench_lm_decode  # noqa: E402


def _timeline(steps: list[list[tuple[str, float]]]) -> list[tuple[float, float, str]]:
    """(start, end, name) events from per-step lists of (name, duration); kernels back to back
    after a leading ``advance`` (the prefill's last kernel)."""
    events, t = [(0.0, 1.0, "greedy_advance_kernel")], 1.0
    for step in steps:
        for name, dur in step:
            events.append((t, t + dur, name))
            t += dur
    return events


STEP = [("take", 1.0), ("gemv_qkv", 5.0), ("attention", 4.0), ("greedy_advance_kernel", 2.0)]


def test_increments_sum_to_the_span():
    out = bench_lm_decode.step_increments(_timeline([STEP] * 4), steps=4)
    assert out["steps"] == 4 and out["kernels"] == 4
    assert out["span_us"] == pytest.approx(12.0)
    by_name = {name: inc for _, name, inc in out["by_position"]}
    assert by_name == {"take": 1.0, "gemv_qkv": 5.0, "attention": 4.0,
                       "greedy_advance_kernel": 2.0}
    assert out["by_position"][0][1] == "gemv_qkv"  # largest first


def test_overlapped_kernel_counts_only_what_it_adds():
    # the attention starts early (programmatic launch) and ends 1 µs after the GEMV
    events = [(0.0, 1.0, "greedy_advance_kernel"), (1.0, 6.0, "gemv_qkv"),
              (2.0, 7.0, "attention"), (7.0, 8.0, "greedy_advance_kernel")]
    out = bench_lm_decode.step_increments(events, steps=1)
    assert {name: inc for _, name, inc in out["by_position"]}["attention"] == pytest.approx(1.0)
    assert out["span_us"] == pytest.approx(7.0)


def test_a_step_with_a_stray_event_is_left_out():
    stray = STEP[:2] + [("Memcpy DtoH", 0.5)] + STEP[2:]
    out = bench_lm_decode.step_increments(_timeline([STEP, stray, STEP, STEP]), steps=4)
    assert out["steps"] == 3 and out["events_per_step"] == {5: 3, 6: 1}
    assert out["span_us"] == pytest.approx(12.0)


def test_no_whole_step():
    out = bench_lm_decode.step_increments([(0.0, 1.0, "greedy_advance_kernel")], steps=4)
    assert "error" in out


def test_kernel_time_of_whole_steps():
    # busy time: durations of the step's kernels, overlapped or not (the leading advance is the
    # previous step's)
    events = [(0.0, 1.0, "greedy_advance_kernel"), (1.0, 6.0, "gemv_qkv"),
              (2.0, 7.0, "attention"), (7.0, 8.0, "greedy_advance_kernel")]
    out = bench_lm_decode.step_increments(events, steps=1)
    assert out["kernel_us"] == pytest.approx(11.0)
    assert bench_lm_decode.step_increments(_timeline([STEP] * 3), steps=3)["kernel_us"] == 12.0
