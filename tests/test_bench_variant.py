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



def test_variant_tuning_db_is_not_an_options_field(monkeypatch, tmp_path):
    """``tuning_db:PATH`` in a variant goes to ``tvmfuse.compile(tuning_db=)``; the other fields
    still build the Options (and the entry keeps what was asked)."""
    seen = []

    def fake_compile(model, inputs, target, workdir, name, options=None, tuning_db=None):
        seen.append((options, tuning_db))
        return (lambda *a: None), 0.0

    monkeypatch.setattr(common, "compile_and_load", fake_compile)
    args = common.parser(None).parse_args(
        ["--variant", f"t=tuning_db:{tmp_path},cuda_graph:true", "--variant", "plain=cuda_graph:false",
         "--workdir", str(tmp_path)])
    wl = common.Workload(name="w", module=None, inputs=(), shape="", dtype="float16")
    built = common._compile_variants(wl, args, lambda msg: None)
    assert built["t"][0]["options"] == {"tuning_db": str(tmp_path), "cuda_graph": True}
    (opts_t, db_t), (opts_p, db_p) = seen
    assert db_t == str(tmp_path) and opts_t == Options(cuda_graph=True)
    assert db_p is None and opts_p == Options(cuda_graph=False)


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
