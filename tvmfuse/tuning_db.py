"""The tuning database: MetaSchedule records plus tvmfuse's per-task summary, and applying it.

A database is a directory::

    database_workload.json        MetaSchedule JSONDatabase: one line per task module
    database_tuning_record.json   MetaSchedule JSONDatabase: the best tuned record per task
    tvmfuse_tasks.json            {"format", "target", "provenance", "tasks": {key: summary}}

A task's summary holds ``default_ms`` (the default rule's schedule, measured in the same run),
``tuned_ms`` (the best MetaSchedule record) and ``use_tuned`` = ``tuned_ms < default_ms``; a task
is *finished* once it is in ``tvmfuse_tasks.json``. Kernels tvmfuse generates from a config (the
sm_90a GEMM and attention, :mod:`tvmfuse.kernel_configs`) are recorded as ``space =
"configs:<kernel>"`` with the fastest ``config``, every candidate's time, and ``use_tuned`` only
when that config beats the default config by more than timing noise; they have no MetaSchedule
record. Every file is written whole to a temporary file
and moved into place with ``os.replace`` (atomic on POSIX), workloads first and the summary last,
so a run killed at any point leaves the finished tasks readable and consistent.

:class:`ApplyTuningDatabase` is the pipeline stage before ``schedule``; it reads records as values
and applies them with the kernels' own generators (:func:`apply_config`), never importing the
tuning search (:mod:`tvmfuse.kernel_configs`, :mod:`tvmfuse.tune`): a kernel with a usable,
faster record gets the recorded schedule (marked ``tirx.is_scheduled``); every other kernel is left
to the default rules. Each kernel considered carries ``"tvmfuse.tuning"``: ``"tuned"`` or
``"default: <why>"``, which the report shows.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import meta_schedule as ms

from .attrs import CONFIG_ATTR, KERNEL_TILE_ATTR, SPEC_ATTR, TUNING_ATTR
from .errors import TVM_ERRORS, CompileError
from .kernels.attention.flash_sm90 import Sm90FlashConfig, flash_attention_sm90_primfunc
from .kernels.attention.spec import spec_from_json
from .kernels.gemm.epilogue import NotHandled
from .kernels.gemm.sm90 import GemmConfig, check
from .rules.gemm_sm90 import gemm_problem
from .targets import TargetSpec
from .tvm_setup import codegen_scope
from .tvmscript_frames import cuda_tensor_intrinsics

FORMAT = "tvmfuse-tuning/1"
TASKS_FILE = "tvmfuse_tasks.json"
WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"


def task_module(func: tirx.PrimFunc) -> tvm.IRModule:
    """The module a kernel is tuned and looked up as: ``{"main": func}`` exported as ``main``."""
    if func.attrs and TUNING_ATTR in func.attrs:
        func = func.without_attr(TUNING_ATTR)
    return tvm.IRModule({"main": func.with_attrs({"global_symbol": "main", "tirx.noalias": True})})


def task_key(mod: tvm.IRModule) -> str:
    """Structural hash of a task module, as a string (stable across processes)."""
    return f"{tvm_ffi.structural_hash(mod) & 0xFFFFFFFFFFFFFFFF:016x}"


def attention_key(spec_text: str) -> str:
    """Database key of an attention kernel: its spec's (a new generator keeps the records)."""
    return "attention_sm90-" + hashlib.sha256(spec_text.encode()).hexdigest()[:16]


def task_key_of(func: tirx.PrimFunc) -> str:
    """Database key of a kernel: the spec's for attention kernels, else the function's hash."""
    if func.attrs is not None and SPEC_ATTR in func.attrs:
        return attention_key(str(func.attrs[SPEC_ATTR]))
    return task_key(task_module(func))


def apply_config(func: tirx.PrimFunc, kind: str, cfg: dict[str, Any]) -> tirx.PrimFunc:
    """``func`` set up to use ``cfg``: a GEMM marked for the ``gemm_sm90`` stage, an attention
    kernel regenerated (its attributes kept). Raises ValueError / NotHandled when ``cfg`` does not
    fit."""
    if kind == "gemm_sm90":
        # the gemm_sm90 stage generates the kernel; here only: does cfg fit this GEMM?
        reason = check(gemm_problem(func), GemmConfig(**cfg))
        if reason:
            raise NotHandled(reason)
        return func.with_attr(CONFIG_ATTR, json.dumps(cfg, sort_keys=True))
    if kind == "attention_sm90":
        if func.attrs is None or SPEC_ATTR not in func.attrs:
            raise ValueError("not an sm_90a flash-attention kernel")
        spec = spec_from_json(str(func.attrs[SPEC_ATTR]))
        new = task_module(flash_attention_sm90_primfunc(spec, config=Sm90FlashConfig(**cfg)))["main"]
        attrs = dict(func.attrs)
        attrs[KERNEL_TILE_ATTR] = new.attrs[KERNEL_TILE_ATTR]
        new = new.with_attrs(attrs)
        return new.without_attr("global_symbol") if "global_symbol" not in func.attrs else new
    raise ValueError(f"unknown kernel config kind {kind!r}")


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _lines(path: Path):
    """``("FILE:LINE", text)`` for each non-blank line of ``path``."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise CompileError(f"tuning database {path}: not text ({err})") from err
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            yield f"{path}:{number}", line


def _check_tasks(tasks: Any, summary: Path) -> None:
    """Every task summary is an object whose times are numbers (or null)."""
    if not isinstance(tasks, dict):
        raise CompileError(f"tuning database {summary}: 'tasks' is a {type(tasks).__name__}, "
                           "expected an object")
    for key, task in tasks.items():
        bad = not isinstance(task, dict) or any(
            task.get(f) is not None and not isinstance(task.get(f), (int, float))
            for f in ("default_ms", "tuned_ms"))
        if bad:
            raise CompileError(f"tuning database {summary}: task {key!r} is not a summary with "
                               f"numeric default_ms / tuned_ms: {str(task)[:200]}")


@dataclass
class TuningDatabase:
    """An on-disk tuning database (see the module docstring); ``tasks`` maps key → summary."""

    path: Path
    target: str | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: dict[str, Any] = field(default_factory=dict)  # key → (workload JSON, record JSON, Workload)

    @classmethod
    def open(cls, path: str | os.PathLike, create: bool = False) -> TuningDatabase:
        """Read ``path``; with ``create`` a missing directory is an empty database."""
        path = Path(path)
        db = cls(path)
        summary = path / TASKS_FILE
        if not summary.is_file():
            if create:
                return db
            raise CompileError(f"tuning database {path}: no {TASKS_FILE} (write one with "
                               f"`tvmfuse tune MODEL --db {path}`)")
        try:
            meta = json.loads(summary.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CompileError(f"tuning database {path}: {TASKS_FILE} is not JSON ({err})") from err
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise CompileError(f"tuning database {path}: {TASKS_FILE} has format {found!r}, "
                               f"expected {FORMAT!r}")
        db.target, db.provenance, db.tasks = meta.get("target"), meta.get("provenance", {}), \
            meta.get("tasks", {})
        _check_tasks(db.tasks, summary)
        if (path / WORKLOAD_FILE).is_file() and (path / RECORD_FILE).is_file():
            db._read_records()
        return db

    def _read_records(self) -> None:
        """Read the JSONDatabase files line by line, keeping each finished task's record as JSON:
        it is parsed only when ``compile`` wants it (:meth:`tuned_func`), so a record that no
        longer parses costs only its own kernel, where MetaSchedule's loader fails the database.
        A line that is not a workload / ``[index, record]`` (a corrupt file) is a CompileError
        naming the file and line."""
        workloads = []
        for where, line in _lines(self.path / WORKLOAD_FILE):
            try:
                wl_json = json.loads(line)
                wl = ms.database.Workload.from_json(wl_json)
            except (json.JSONDecodeError, *TVM_ERRORS) as err:
                raise CompileError(f"tuning database {where}: not a MetaSchedule workload "
                                   f"({type(err).__name__}: {str(err).strip()[:200]})") from err
            workloads.append((wl_json, wl, task_key(wl.mod)))
        for where, line in _lines(self.path / RECORD_FILE):
            try:
                index, rec_json = json.loads(line)
                wl_json, wl, key = workloads[index]
            except (json.JSONDecodeError, ValueError, TypeError, IndexError) as err:
                raise CompileError(f"tuning database {where}: not an [index, record] line of "
                                   f"the {len(workloads)} workloads ({type(err).__name__}: "
                                   f"{str(err)[:200]})") from err
            if key in self.tasks:  # records of unfinished tasks are ignored
                self.records[key] = (wl_json, rec_json, wl)

    def finish_task(self, key: str, summary: dict[str, Any], mod: tvm.IRModule | None = None,
                    record: Any = None) -> None:
        """Add one finished task (its TuningRecord, if any) and rewrite the database atomically."""
        self.tasks[key] = summary
        if record is not None:
            wl = ms.database.MemoryDatabase().commit_workload(mod)
            self.records[key] = (wl.as_json(), record.as_json(), wl)
        self.save()

    def save(self) -> None:
        """Rewrite every file (temp + ``os.replace``): records first, the task summary last."""
        self.path.mkdir(parents=True, exist_ok=True)
        entries = list(self.records.values())
        # workload i ↔ record i: the files keep MetaSchedule's JSONDatabase format
        _write_atomic(self.path / WORKLOAD_FILE, "".join(json.dumps(w) + "\n" for w, _, _ in entries))
        _write_atomic(self.path / RECORD_FILE, "".join(
            json.dumps([i, r]) + "\n" for i, (_, r, _) in enumerate(entries)))
        _write_atomic(self.path / TASKS_FILE, json.dumps(
            {"format": FORMAT, "target": self.target, "provenance": self.provenance,
             "tasks": self.tasks}, indent=1) + "\n")

    def tuned_func(self, key: str) -> tirx.PrimFunc | None:
        """The recorded schedule of task ``key`` replayed on its module (None if no record)."""
        if key not in self.records:
            return None
        _, rec_json, wl = self.records[key]
        try:
            rec = ms.database.TuningRecord.from_json(rec_json, wl)
        except Exception as err:  # tensorized traces need the CUDA intrinsics registered
            if "TensorIntrin" not in str(err):
                raise
            cuda_tensor_intrinsics()  # only when a record needs it

            rec = ms.database.TuningRecord.from_json(rec_json, wl)
        sch = s_tir.Schedule(wl.mod)
        rec.trace.apply_to_schedule(sch, remove_postproc=False)
        return sch.mod["main"]


def _check_builds(func: tirx.PrimFunc, spec: TargetSpec) -> None:
    """Codegen of one kernel alone (CUDA kept as source, as in ``pipeline.build``)."""
    with codegen_scope():
        tvm.compile(task_module(func), target=spec.tvm_target())


def _restore_attrs(tuned: tirx.PrimFunc, original: tirx.PrimFunc) -> tirx.PrimFunc:
    attrs = dict(original.attrs) if original.attrs else {}
    attrs.update({"tirx.is_scheduled": True, TUNING_ATTR: "tuned"})
    if "global_symbol" not in attrs:  # the task module's "main" is not this kernel's name
        tuned = tuned.without_attr("global_symbol")
    return tuned.with_attrs(attrs)


def choose_schedule(db: TuningDatabase, func: tirx.PrimFunc, spec: TargetSpec) -> tuple[
        tirx.PrimFunc | None, str]:
    """``(tuned func, "tuned")`` or ``(None, "default: <reason>")`` for one kernel."""
    key = task_key_of(func)
    summary = db.tasks.get(key)
    if summary is None:
        return None, "default: no record"
    if str(summary.get("space", "")).startswith("configs:"):  # a kernel config, not a trace
        if not summary.get("use_tuned") or summary.get("config") is None:
            t, d = summary.get("tuned_ms"), summary.get("default_ms")
            if t is not None and d is not None and t < d:
                return None, (f"default: the fastest other config ({t:.4g} vs {d:.4g} ms) is "
                              "within timing noise")
            return None, "default: the default config was fastest"
        try:
            tuned = apply_config(func, summary["space"].removeprefix("configs:"), summary["config"])
        except Exception as err:  # a config the generator no longer takes: keep the default
            return None, f"default: tuned config unusable ({str(err).strip().splitlines()[-1][:200]})"
        return tuned.with_attr(TUNING_ATTR, "tuned"), "tuned"
    tuned_ms, default_ms = summary.get("tuned_ms"), summary.get("default_ms")
    if tuned_ms is None:
        return None, "default: no tuned candidate ran"
    if default_ms is not None and not tuned_ms < default_ms:
        return None, f"default: tuned not faster ({tuned_ms:.4g} vs {default_ms:.4g} ms)"
    try:
        tuned = db.tuned_func(key)
        if tuned is None:
            return None, "default: record missing"
        _check_builds(tuned, spec)
    except Exception as err:  # a record that no longer replays or builds: keep the default
        return None, f"default: tuned build failed ({str(err).strip().splitlines()[-1][:200]})"
    return _restore_attrs(tuned, func), "tuned"


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.ApplyTuningDatabase")
class ApplyTuningDatabase:
    """Replace kernels by their tuned schedules where the database says tuned is faster.

    Must run after ``FuseTIR`` (tasks are fused kernels) and before the default ``schedule``
    stage, which schedules every kernel this pass leaves unscheduled.
    """

    def __init__(self, path: str | os.PathLike, spec: TargetSpec) -> None:
        self.db = TuningDatabase.open(path)
        self.spec = spec

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = mod.clone()  # assigned into below: not the caller's module
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            configurable = func.attrs is not None and SPEC_ATTR in func.attrs  # attention kernels
            if func.attrs and func.attrs.get("tirx.is_scheduled", False) and not configurable:
                continue
            tuned, why = choose_schedule(self.db, func, self.spec)
            updates[gvar] = tuned if tuned is not None else func.with_attr(TUNING_ATTR, why)
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def tuning_summary(path: str | os.PathLike, lowered: tvm.IRModule) -> dict[str, Any]:
    """Library metadata: the database's provenance and, per kernel, tuned or default (and why)."""
    db = TuningDatabase.open(path)
    kernels = {gv.name_hint: str(f.attrs[TUNING_ATTR]) for gv, f in lowered.functions_items()
               if isinstance(f, tirx.PrimFunc) and f.attrs and TUNING_ATTR in f.attrs}
    return {"db": str(path), "provenance": db.provenance, "kernels": kernels,
            "tuned": sum(v == "tuned" for v in kernels.values())}
