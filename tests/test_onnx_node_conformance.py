"""The ONNX backend node tests against the recorded status (tests/data/onnx_node_status.json).

Each test is compiled through the public API for the cpu target, run in a forked child with a
timeout and compared with onnx's expected outputs (tools/onnx_conformance.py holds the harness).
CI runs a deterministic stratified subset: per operator, its first test of each recorded status
(every op at least once). ``TVMFUSE_ONNX_FULL=1`` runs all of them. A regression fails; so does an
improvement, asking for the status file to be regenerated:

    python tools/onnx_conformance.py -j 2 --update
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tools import onnx_conformance as conf

pytest.importorskip("onnx")

_RANK = {"crash": 0, "wrong": 1, "refused": 2, "pass": 3}


@pytest.fixture(scope="module")
def cases() -> list[conf.Case]:
    return conf.load_cases()


def test_status_file_covers_the_installed_onnx(cases):
    import onnx

    expected = conf.load_expected()
    assert set(expected) == {c.name for c in cases}, (
        f"tests/data/onnx_node_status.json does not list the node tests of onnx {onnx.__version__}; "
        "regenerate it with python tools/onnx_conformance.py --update")


def test_no_wrong_answers_or_crashes_recorded():
    """The issue's bar: not one silent wrong answer and not one crash over all node tests."""
    bad = {n: e for n, e in conf.load_expected().items() if e["status"] in ("wrong", "crash")}
    assert not bad, f"{len(bad)} node tests are recorded wrong or crashing: {sorted(bad)[:20]}"


# One test per cause of a former wrong answer or crash, run whatever the CI subset picks: a Relax
# pass (SinkReshape on Trilu's runtime k), a legalisation (max from the lowest finite value in the
# Attention _expanded guard), a converter (Expand's runtime shape) or a refusal (training Dropout,
# fp8 / int4 Casts, sequence outputs).
_FORMERLY_WRONG = ["test_tril_square_neg", "test_expand_dim_changed", "test_training_dropout",
                   "test_attention_causal_boolmask_nan_robustness_expanded",
                   "test_cast_FLOAT_to_FLOAT8E4M3FN", "test_cast_FLOAT_to_INT4", "test_if_seq"]


def test_former_wrong_answers_stay_fixed(cases):
    chosen = [c for c in cases if c.name in _FORMERLY_WRONG]
    results = conf.run_cases(chosen, jobs=min(2, os.cpu_count() or 1), timeout=120)
    bad = {n: r for n, r in results.items() if r["status"] in ("wrong", "crash")}
    assert len(results) == len(_FORMERLY_WRONG) and not bad, bad


def test_node_tests_match_recorded_status(cases):
    expected = conf.load_expected()
    chosen = cases if os.environ.get("TVMFUSE_ONNX_FULL") else conf.ci_subset(cases)
    results = conf.run_cases(chosen, jobs=min(2, os.cpu_count() or 1), timeout=120)
    worse, better = [], []
    for name, r in sorted(results.items()):
        want = expected.get(name, {}).get("status", "refused")
        if _RANK[r["status"]] < _RANK[want]:
            worse.append(f"{name}: {want} -> {r['status']}: {r['detail'][:200]}")
        elif _RANK[r["status"]] > _RANK[want]:
            better.append(f"{name}: {want} -> {r['status']}")
    assert not worse, f"{len(worse)} node tests regressed:\n" + "\n".join(worse)
    assert not better, (
        f"{len(better)} node tests improved; record it with python tools/onnx_conformance.py "
        "-j 2 --update:\n" + "\n".join(better))


def test_exclusions_follow_the_issue(cases):
    """Excluded: non-default domains, non-tensor / string / fp8 / int4 I/O, random outputs."""
    by_name = {c.name: c for c in cases}
    assert conf.exclusion(by_name["test_add"]) is None
    assert conf.exclusion(by_name["test_bernoulli"]).startswith("random output")
    assert conf.exclusion(by_name["test_adagrad"]).startswith("non-default domain")
    assert conf.exclusion(by_name["test_sequence_insert_at_back"]).startswith("non-tensor")
    assert conf.exclusion(by_name["test_cast_FLOAT_to_FLOAT8E4M3FN"]) == "float8e4m3fn I/O"
    assert conf.exclusion(by_name["test_strnormalizer_export_monday_casesensintive_lower"]) \
        == "string I/O"


def test_compare_checks_shape_dtype_and_values():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert conf._compare([x], [x + 1e-6], 1e-3, 1e-4) is None
    assert "shape" in conf._compare([x.reshape(6)], [x], 1e-3, 1e-4)
    assert "dtype" in conf._compare([x.astype(np.float64)], [x], 1e-3, 1e-4)
    assert "differ" in conf._compare([x + 1], [x], 1e-3, 1e-4)
    assert "differ" in conf._compare([np.array([1, 2])], [np.array([1, 3])], 1e-3, 1e-4)
    assert conf._compare([np.array(np.nan)], [np.array(np.nan)], 1e-3, 1e-4) is None
