"""``--variant NAME=FIELD:VALUE,…`` of the bench scripts (tools/bench/common.py): values are JSON
literals (or Python's True / False / None) or else strings, and each names an existing
``tvmfuse.Options`` field of the type it declares. Also the settling before a CUDA timing."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools", "bench"))
import common  # noqa: E402

from tvmfuse.options import Options  # noqa: E402


def test_parse_variant_values():
    name, fields = common.parse_variant("g=cuda_graph:true,programmatic_launch:all,gemv_max_m:64")
    assert name == "g"
    assert fields == {"cuda_graph": True, "programmatic_launch": "all", "gemv_max_m": 64}
    assert dataclasses.replace(Options(), **fields).gemv_max_m == 64


@pytest.mark.parametrize("text", ["nofields", "=cuda_graph:true", "x=cuda_graph"])
def test_parse_variant_rejects_malformed(text):
    with pytest.raises(SystemExit, match="--variant"):
        common.parse_variant(text)


def test_parser_takes_repeated_variants():
    args = common.parser(None).parse_args(["--variant", "a=cuda_graph:true", "--variant", "b=x:1"])
    assert args.variant == ["a=cuda_graph:true", "b=x:1"]


def test_python_booleans_are_booleans():
    """``FIELD:False`` is the boolean (the string "False" is truthy: session 22's first A/B timed
    three identical builds)."""
    _, fields = common.parse_variant("s=sm90_vector_operands:False,cuda_graph:True")
    assert fields == {"sm90_vector_operands": False, "cuda_graph": True}



def test_settle_calls_until_the_time_passed(monkeypatch):
    """``settle``: calls in tens with a synchronization after each ten, until ``seconds`` passed;
    nothing for 0 s; ``time_stats`` settles on CUDA only (a CPU timing is unchanged)."""
    syncs: list[str] = []
    monkeypatch.setattr(common, "sync", syncs.append)
    clock = iter(float(i) for i in range(1000))  # perf_counter: one second per reading
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
    calls: list[int] = []
    assert common.settle(lambda: calls.append(1), "cuda", 3.0) == 30
    assert len(calls) == 30 and syncs == ["cuda"] * 3
    assert common.settle(lambda: calls.append(1), "cuda", 0.0) == 0 and len(calls) == 30
    monkeypatch.undo()
    called = []
    monkeypatch.setattr(common, "settle", lambda *a: called.append(a))
    common.time_stats(lambda: None, warmup=1, iters=2, device="cpu")
    assert not called
