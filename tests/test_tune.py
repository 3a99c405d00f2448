"""``tvmfuse tune`` on the CPU target: tasks, database, resume, fallback, RPC loopback, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tvmfuse.cli import check_against_reference
from tvmfuse.errors import CompileError, TvmfuseError
from tvmfuse.frontend import import_model
from tvmfuse.targets import get_target

REPO = Path(__file__).resolve().parents[1]
MODEL = "models.mlp_block:small"  # LayerNorm stats → Linear+GELU → Linear+residual
ALL = {"min_gflop": 0.0, "min_mb": 0.0}  # tune every GEMM and norm kernel of the tiny model
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory) -> Path:
    from tvmfuse.tune import tune

    db = tmp_path_factory.mktemp("tune") / "db"
    report = tune(MODEL, db=db, target="cpu", trials=4, progress=False, **ALL)
    assert {r.pattern for r in report.results} == {"norm", "gemm_epilogue"}
    return db


def _kernels(db: Path | None) -> dict[str, str | None]:
    from tvmfuse.report import analyze

    mod = import_model(MODEL, None, {}).mod
    return {k["name"]: k.get("tuning") for k in analyze(mod, get_target("cpu"), tuning_db=db)["kernels"]}


def test_extract_and_select_tasks():
    from tvmfuse.tune import extract_tasks, select_tasks

    tasks = extract_tasks(import_model(MODEL, None, {}).mod, get_target("cpu"))
    patterns = [t.pattern for t in tasks]
    assert patterns.count("gemm_epilogue") == 2 and "norm" in patterns  # fc1+GELU, fc2+residual
    gemm = max(tasks, key=lambda t: t.flops)
    # x (2·16, 64) · W1ᵀ (64, 256) plus the epilogue's few ops per output element
    assert 2 * 32 * 64 * 256 <= gemm.flops < 1.2 * 2 * 32 * 64 * 256
    assert all(t.mod["main"].attrs["global_symbol"] == "main" for t in tasks)
    # default thresholds: the tiny model's kernels are all too small to be worth tuning
    assert select_tasks(tasks) == []
    assert all(t.skip and ("GFLOP" in t.skip or "MB" in t.skip) for t in tasks)
    assert len(select_tasks(tasks, min_gflop=0.001, min_mb=1e9)) == 2  # GEMMs only
    every = select_tasks(tasks, **ALL)
    assert {t.pattern for t in every} == {"gemm_epilogue", "norm"}
    assert all(t.skip == f"{t.pattern} kernel" for t in tasks if t not in every)


def test_tune_writes_db_and_compile_uses_it(tuned_db: Path):
    import tvmfuse

    meta = json.loads((tuned_db / "tvmfuse_tasks.json").read_text())
    assert meta["format"] == "tvmfuse-tuning/1" and meta["target"] == "cpu"
    assert meta["provenance"]["trials"] == 4 and meta["provenance"]["versions"]["apache-tvm"]
    for s in meta["tasks"].values():
        assert s["default_ms"] > 0 and s["trials"] == 4
        assert s["use_tuned"] == (s["tuned_ms"] is not None and s["tuned_ms"] < s["default_ms"])
    assert (tuned_db / "database_tuning_record.json").stat().st_size > 0
    kernels = _kernels(tuned_db)
    by_name = {s["name"]: s for s in meta["tasks"].values()}
    assert set(by_name) <= set(kernels)
    for name, tuning in kernels.items():
        used = name in by_name and by_name[name]["use_tuned"]
        assert tuning == "tuned" if used else tuning.startswith("default")
    lib = tvmfuse.compile(MODEL, target="cpu", tuning_db=tuned_db)
    assert max(check_against_reference(lib)) < 1e-4
    assert kernels.items() <= lib.metadata["tuning"]["kernels"].items()
    assert lib.metadata["tuning"]["provenance"]["trials"] == 4


def test_fallback_slower_or_broken_record(tuned_db: Path, tmp_path: Path):
    import shutil

    import tvmfuse
    from tvmfuse.tuning_db import TuningDatabase

    work = tmp_path / "db"
    shutil.copytree(tuned_db, work)
    db = TuningDatabase.open(work)
    keys = sorted(db.records)
    assert len(keys) >= 2, "the tiny tune should leave records for every task"
    a, b, c = sorted(db.tasks, key=lambda k: db.tasks[k]["name"])[:3]
    # a: tuned "faster" on paper but its record is another kernel's schedule → replay fails
    db.tasks[a].update(tuned_ms=db.tasks[a]["default_ms"] / 10)
    db.records[a] = (db.records[a][0], db.records[b][1], db.records[a][2])
    # b: the record measured slower than the default
    db.tasks[b].update(tuned_ms=db.tasks[b]["default_ms"] * 2)
    # c: no record at all
    db_c_name = db.tasks.pop(c)["name"]
    db.save()
    kernels = _kernels(work)
    names = {k: db.tasks[k]["name"] for k in (a, b)}
    assert kernels[names[a]].startswith("default: tuned build failed")
    assert kernels[names[b]].startswith("default: tuned not faster")
    assert kernels[db_c_name] == "default: no record"
    lib = tvmfuse.compile(MODEL, target="cpu", tuning_db=work)
    assert max(check_against_reference(lib)) < 1e-4


def test_resume_after_kill(tmp_path: Path):
    """SIGKILL right after the first task is written; the rerun keeps it and tunes the rest."""
    from tvmfuse.tune import tune

    db = tmp_path / "db"
    script = textwrap.dedent(f"""
        import os, signal
        from tvmfuse import tuning_db
        save = tuning_db.TuningDatabase.save
        def save_then_die(self):
            save(self)
            os.kill(os.getpid(), signal.SIGKILL)
        tuning_db.TuningDatabase.save = save_then_die
        from tvmfuse.tune import tune
        tune({MODEL!r}, db={str(db)!r}, target="cpu", trials=2, progress=False,
             min_gflop=0.0, min_mb=0.0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    first = json.loads((db / "tvmfuse_tasks.json").read_text())["tasks"]
    assert len(first) == 1
    report = tune(MODEL, db=db, target="cpu", trials=2, progress=False, **ALL)
    assert [r.resumed for r in report.results].count(True) == 1
    done = json.loads((db / "tvmfuse_tasks.json").read_text())["tasks"]
    assert len(done) == len(report.results) >= 3
    (key, summary), = first.items()
    assert done[key] == summary  # the finished task was not redone


def test_rpc_two_local_servers(tmp_path: Path):
    """--gpus 2 on the CPU target: TVM's tracker + two RPC servers on loopback, RPCRunner."""
    from tvmfuse.tune import tune

    db = tmp_path / "db"
    report = tune(MODEL, db=db, target="cpu", trials=2, progress=False, gpus=2, min_gflop=0.001,
                  min_mb=1e9)
    assert len(report.results) == 2
    assert all(r.default_ms is not None and r.tuned_ms is not None for r in report.results)
    prov = json.loads((db / "tvmfuse_tasks.json").read_text())["provenance"]
    assert prov["gpus"] == 2 and prov["rpc"].startswith("127.0.0.1:")


def test_parse_rpc_and_missing_db(tmp_path: Path):
    import tvmfuse
    from tvmfuse.tune import parse_rpc

    assert parse_rpc("10.0.0.1:9190:h200") == ("10.0.0.1", 9190, "h200")
    with pytest.raises(TvmfuseError, match="HOST:PORT:KEY"):
        parse_rpc("localhost:h200")
    with pytest.raises(CompileError, match="no tvmfuse_tasks.json"):
        tvmfuse.compile(MODEL, target="cpu", tuning_db=tmp_path / "nothing")


def test_gpus_without_tornado_names_the_extra(tmp_path: Path, monkeypatch):
    """--gpus starts TVM's RPC tracker, which imports tornado (the [tune] extra): said up front,
    before the model is imported; plain tune needs only the base install (psutil, cloudpickle)."""
    import importlib.util

    import tvmfuse.tune as tune_mod

    real = importlib.util.find_spec
    monkeypatch.setattr(tune_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tornado" else real(name, *a))
    with pytest.raises(TvmfuseError, match=r"--gpus .* needs tornado: install tvmfuse\[tune\]"):
        tune_mod.tune("no_such_pkg.mod:factory", db=tmp_path / "db", target="cpu", gpus=2)
    base = (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]")[0]
    assert '"psutil"' in base and '"cloudpickle"' in base


def test_cli_tune_then_compile(tmp_path: Path):
    db, lib = tmp_path / "db", tmp_path / "m.so"
    cli = [sys.executable, "-m", "tvmfuse.cli"]
    tune = subprocess.run(cli + ["tune", MODEL, "--target", "cpu", "--trials", "4", "--db", str(db),
                                 "--min-gflop", "0", "--min-mb", "0"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert tune.returncode == 0, tune.stderr[-2000:]
    assert "default ms" in tune.stdout and "speedup" in tune.stdout
    assert len(json.loads((db / "tvmfuse_tasks.json").read_text())["tasks"]) >= 3
    comp = subprocess.run(cli + ["compile", MODEL, "-o", str(lib), "--target", "cpu", "--tuning-db",
                                 str(db), "--check"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert comp.returncode == 0, comp.stderr[-2000:]
    assert ": ok" in comp.stdout and lib.is_file()
