"""``bench_lm_decode.step_increments``: a decode step's span split into each kernel's increment
(its end − the previous kernel's end), averaged over the whole steps between greedy ``advance``
kernels; steps with a stray event (another count) are left out and reported. The interleaved
rounds of ``ab_rounds`` and ``batch_ratio`` (the 7B batch-8 / batch-1 ratio) on fake libraries.
``tie_check``, the issue's token rule, on a fake model."""

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


class _FakeLM:
    """A loaded library's surface the rounds use: ``generate`` logs the call order and returns
    the prompt with ``new`` copies of ``token``; ``timings`` gives the next of ``times``."""

    def __init__(self, name: str, times: list[float], token: int, log: list[str]):
        self.name, self.times, self.token, self.log = name, iter(times), token, log
        self.timings: dict[str, float] = {}
        self.metadata = {"vocab": 50}

    def generate(self, ids, max_new_tokens: int):
        import torch

        self.log.append(self.name)
        self.timings = {"decode_ms_per_token": next(self.times)}
        return torch.cat([ids, torch.full((ids.shape[0], max_new_tokens), self.token)], dim=1)


def test_batch_ratio_takes_turns_and_medians(monkeypatch):
    """Warm-ups first, then one generate each per round in turn; the batch ratio is the median of
    batch N's times over batch 1's, and batch N's prompts start with batch 1's (seed 1)."""
    import torch

    log: list[str] = []
    one = _FakeLM("1", [9.0, 1.0, 3.0, 2.0], 7, log)  # warm-up, then 3 rounds: median 2
    eight = _FakeLM("8", [9.0, 3.0, 2.5, 30.0], 7, log)  # median 3
    torch.manual_seed(1)
    ids = torch.randint(1, 50, (1, 6))
    import tvmfuse

    monkeypatch.setattr(tvmfuse, "load", lambda path, device=None: eight)
    entry, ids_n, got_n = bench_lm_decode.batch_ratio(one, ids, {"library": "x", "compile_s": 1.0},
                                                      8, new=4, rounds=3)
    assert log == ["1", "8"] * 4
    assert entry["median_ms_per_token"] == {"1": 2.0, "8": 3.0}
    assert entry["ratio"] == 1.5
    assert entry["tokens_same_every_round"]
    assert ids_n.shape == (8, 6) and torch.equal(ids_n[:1], ids)
    assert got_n.shape == (8, 10)


def test_batch_ratio_passes_a_failed_compile_on():
    failed = {"error": "the batch compile exited with 1: ..."}
    assert bench_lm_decode.batch_ratio(None, None, failed, 8, 4, 3) == (failed, None, None)


def test_ab_rounds_flags_other_tokens():
    import torch

    log: list[str] = []
    base = _FakeLM("base", [1.0] * 5, 7, log)
    same = _FakeLM("same", [2.0] * 4, 7, log)
    other = _FakeLM("other", [0.5] * 4, 8, log)
    ids = torch.ones(1, 3, dtype=torch.long)
    out = bench_lm_decode.ab_rounds(base, {"same": same, "other": other}, ids, 4, 3,
                                    base.generate(ids, 4))
    assert out["over_base"] == {"same": 2.0, "other": 0.5}
    assert out["tokens_equal"] == {"same": True, "other": False}


class _FakeModel:
    """A causal LM whose logits after each prefix come from ``table[prefix]``: (top token,
    runner-up, gap), the top at 10.0 and the runner-up ``gap`` below it, 1.0 elsewhere. A prefix
    not in the table picks the sequence's own next token by a clear margin."""

    def __init__(self, table: dict[tuple[int, ...], tuple[int, int, float]], vocab: int = 8):
        self.table, self.vocab = table, vocab

    def __call__(self, seq):
        import types

        import torch

        toks = seq[0].tolist()
        logits = torch.ones(1, len(toks), self.vocab)
        for n in range(1, len(toks) + 1):
            own = toks[n] if n < len(toks) else 0
            top, second, gap = self.table.get(tuple(toks[:n]), (own, (own + 1) % self.vocab, 0.5))
            logits[0, n - 1, top], logits[0, n - 1, second] = 10.0, 10.0 - gap
        return types.SimpleNamespace(logits=logits)


def _tie_check(table, seq, ref, ctx=2):
    import torch

    return bench_lm_decode.tie_check(_FakeModel(table), torch.tensor([seq]), ctx, torch.tensor([ref]))


def test_tie_check_equal_tokens_pass_when_torchs_one_pass_forward_disagrees():
    """tvmfuse's tokens are torch's greedy ones; torch's teacher-forced forward picks another
    token at step 1 (its own two paths disagree): listed, not judged."""
    out = _tie_check({(1, 2, 3): (5, 4, 0.5)}, seq=[1, 2, 3, 4, 0], ref=[1, 2, 3, 4, 0])
    assert out["equal"] and out["ok"] and out["differing_steps"] == []
    assert [(b["step"], b["tie"]) for b in out["teacher_forced_only"]] == [(1, False)]
    assert out["first_step_parting_from_eager"] is None


def test_tie_check_parting_at_a_clear_choice_fails():
    """tvmfuse parts from torch's greedy tokens at step 1 where torch's top-2 gap is 5e-2."""
    out = _tie_check({(1, 2, 3): (5, 4, 0.5)}, seq=[1, 2, 3, 4, 0], ref=[1, 2, 3, 5, 0])
    assert not out["ok"] and out["first_step_parting_from_eager"] == 1
    assert [(b["step"], b["tie"], b["within_2e-2"]) for b in out["differing_steps"]] == [(1, False, False)]


def test_tie_check_parting_at_a_tie_passes_and_later_steps_are_judged():
    """Parting at a tie (top-2 gap 1e-4 relative) is allowed; a later non-tie mismatch on
    tvmfuse's prefix fails."""
    table = {(1, 2, 3): (5, 4, 1e-3)}
    assert _tie_check(table, seq=[1, 2, 3, 4, 0], ref=[1, 2, 3, 5, 0])["ok"]
    later = {**table, (1, 2, 3, 4): (6, 1, 0.5)}
    out = _tie_check(later, seq=[1, 2, 3, 4, 0], ref=[1, 2, 3, 5, 0])
    assert not out["ok"] and [b["step"] for b in out["differing_steps"]] == [1, 2]


def test_tie_check_parting_where_torchs_forward_agrees_is_still_judged():
    """At the parting step torch's teacher-forced argmax is tvmfuse's token but by a clear margin
    over the greedy reference's: the parting step needs a tie all the same."""
    out = _tie_check({(1, 2, 3): (4, 5, 0.5)}, seq=[1, 2, 3, 4, 0], ref=[1, 2, 3, 5, 0])
    assert not out["ok"] and [b["step"] for b in out["differing_steps"]] == [1]
