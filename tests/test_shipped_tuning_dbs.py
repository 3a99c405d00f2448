"""The tuning databases shipped under ``schedules/``: readable, with provenance, and found by compile."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tvmfuse.tune import CONFIG_MARGIN

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.parent for p in (REPO / "schedules").glob("*/*/tvmfuse_tasks.json"))


def test_there_are_shipped_databases():
    assert len(SHIPPED) >= 3


@pytest.mark.parametrize("db", SHIPPED, ids=lambda p: p.name)
def test_database_and_provenance(db: Path):
    from tvmfuse.tuning_db import TuningDatabase

    opened = TuningDatabase.open(db)
    assert opened.target == db.parent.name  # schedules/<target>/<workload>
    prov = json.loads((db / "provenance.json").read_text())
    for field in ("date", "gpu", "versions", "trials", "workload", "command", "tasks"):
        assert prov.get(field), field
    assert prov["versions"]["apache-tvm-ffi"] == "0.1.14.post1"
    assert opened.tasks
    for summary in opened.tasks.values():
        assert summary["default_ms"] > 0 and summary["trials"] >= 1
        assert summary["name"] in prov["tasks"]
        margin = 0.0
        if str(summary.get("space", "")).startswith("configs:"):
            _check_config_timings(summary)
            margin = CONFIG_MARGIN
        # the recorded decision is the one its timings give, whichever way it went
        assert summary["use_tuned"] == (summary["tuned_ms"] < summary["default_ms"] * (1 - margin))


def _check_config_timings(summary: dict) -> None:
    """A config task's default and tuned times are its candidates' (the tuner's _tune_configs):
    the default is candidate 0 (the faster of its two timings), tuned the fastest other one."""
    cands = summary["candidates"]
    assert len([c for c in cands if c["ms"] is not None]) == summary["trials"]
    assert cands[0]["config"] == summary["default_config"]
    default = min(v for v in (cands[0]["ms"], cands[0].get("ms_again")) if v is not None)
    assert summary["default_ms"] == default
    tuned_ms, tuned = min(((c["ms"], c["config"]) for c in cands[1:] if c["ms"] is not None),
                          key=lambda p: p[0])
    assert summary["tuned_ms"] == tuned_ms and summary["config"] == tuned


def test_attention_database_found_by_compile():
    """The causal B4·S2048 record applies to that model: the kernel's label names the record's
    decision, not a missing record."""
    sys.path.insert(0, str(REPO / "tools" / "bench"))
    import torch
    from bench_attention import SDPA

    from tvmfuse.frontend import import_model
    from tvmfuse.pipeline import lower
    from tvmfuse.targets import get_target

    db = REPO / "schedules" / "sm90" / "attn_causal_4x2048x2048x16x16x128_fp16"
    q = torch.randn(4, 2048, 16, 128, dtype=torch.float16)
    seen = {}
    lower(import_model(SDPA(True, False), (q, q, q), {}).mod, get_target("sm90"), None,
          on_stage=lambda name, mod: seen.setdefault(name, mod), tuning_db=db)
    labels = [str(f.attrs["tvmfuse.tuning"]) for _, f in seen["apply_tuning_db"].functions_items()
              if getattr(f, "attrs", None) is not None and "tvmfuse.attention_spec" in f.attrs]
    assert len(labels) == 1
    assert labels[0].startswith("default:") and "no record" not in labels[0]
