"""``tvmfuse.tune``: MetaSchedule over the kernels of the *fused* model → a tuning database.

Steps, per model:

1. **Tasks.** tvmfuse's ``lower`` runs up to the ``schedule`` stage; each distinct unscheduled
   PrimFunc launched from ``main`` is a task (``weight`` = its launches per forward pass).
2. **Selection** (:func:`select_tasks`). Tuned: ``gemm_epilogue`` / ``norm_gemm`` / ``attention``
   kernels with ≥ ``min_gflop`` GFLOP, and ``norm`` kernels moving ≥ ``min_mb`` MB (each input
   read and each output written once). Elementwise and layout kernels are skipped: they are
   memory-bound and tvmfuse's rules already stream them near copy bandwidth.
3. **Default.** The default rule's schedule (tvmfuse's GPU rules; on ``cpu`` the unscheduled
   kernel as ``compile`` builds it) is built and measured with the same builder and runner.
4. **Search.** MetaSchedule with the union of two design spaces: tvmfuse's rules applied with
   ``tunable=True`` (rules that sample tile sizes expose them to the search; the others give their
   one schedule) and MetaSchedule's generic space for the target (``cuda-tensorcore`` for
   half-precision GEMM/attention on CUDA, with ``tvm.s_tir.tensor_intrin.cuda`` imported; ``cuda``
   otherwise; ``llvm`` on ``cpu``). Cost model: xgboost when importable, else ``random``.
5. **Record.** The best record and ``default_ms``/``tuned_ms`` are written atomically when the task
   finishes (:mod:`tvmfuse.tuning_db`); a rerun skips finished tasks. ``compile --tuning-db``
   uses a record only where ``tuned_ms < default_ms``.

Measurement: locally in this process (``cpu``: no worker start-up, which on a loaded 2-core
machine exceeds MetaSchedule's 30 s worker timeout) or in MetaSchedule's isolated worker processes
(CUDA: a crashing candidate cannot take the tuner down); with ``rpc="HOST:PORT:KEY"`` on the RPC
tracker's servers; ``gpus=N`` starts a local tracker and one server per GPU first.
"""

from __future__ import annotations

import datetime
import importlib.machinery
import importlib.metadata as md
import importlib.util
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import relax, s_tir, tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder.local_builder import default_export
from tvm.s_tir.meta_schedule.runner.local_runner import (
    LocalRunnerFuture,
    default_alloc_argument,
    default_run_evaluator,
)
from tvm.s_tir.meta_schedule.utils import cpu_count
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

from .attrs import SPEC_ATTR
from .errors import TvmfuseError
from .frontend import import_model, input_overrides
from .kernel_configs import attention_flops, space_for
from .pipeline import lower
from .report import classify, fused_groups, kernel_flops, op_name, primfunc_bytes
from .rules import gpu_rules
from .rules.fallback import ApplyRules, apply_rules
from .rules.gemm_sm90 import HYBRID_PIPELINE, Sm90Gemm, uses_tirx
from .targets import TargetSpec, get_target
from .tuning_db import TuningDatabase, task_key_of, task_module
from .tvm_setup import register_tvm_patches
from .tvmscript_frames import cuda_tensor_intrinsics
from .version import __version__

TUNED_PATTERNS = ("gemm_epilogue", "norm_gemm", "attention")
MIN_GFLOP = 0.1  # GEMM-like kernels below this are launch-bound: nothing to gain
MIN_MB = 8.0  # norms below this move too few bytes to matter (2 us at 4.2 TB/s)
# A different kernel config must beat the default by more than timing noise (two timings of one
# kernel differ by ~0.5 % on the H200): tuning never swaps in a config that is not clearly faster.
CONFIG_MARGIN = 0.01
PRE_SCHEDULE_STAGE = "reshape_to_view"  # the last pipeline stage before scheduling


@dataclass
class Task:
    """One distinct kernel of the fused model."""

    name: str
    mod: tvm.IRModule  # {"main": the unscheduled PrimFunc}, see tuning_db.task_module
    key: str
    pattern: str
    ops: list[str]
    flops: int
    bytes: int
    weight: int = 1
    skip: str | None = None  # why it is not tuned (None: tuned)
    space: Any = None  # a kernel_configs.ConfigSpace: tvmfuse's kernel configs are the search space


@dataclass
class TaskResult:
    """What tuning one task gave; ``tuned_ms`` is None when no candidate ran."""

    name: str
    pattern: str
    default_ms: float | None
    tuned_ms: float | None
    trials: int
    seconds: float
    resumed: bool = False
    space: str = "metaschedule"  # or "configs:<kernel>": tvmfuse's kernel configs were searched
    config: dict | None = None  # the fastest non-default config (configs spaces)

    @property
    def use_tuned(self) -> bool:
        if self.tuned_ms is None:
            return False
        if self.default_ms is None:
            return True
        margin = CONFIG_MARGIN if self.space.startswith("configs") else 0.0
        return self.tuned_ms < self.default_ms * (1.0 - margin)

    @property
    def speedup(self) -> float | None:
        if self.tuned_ms is None or self.default_ms is None:
            return None
        return self.default_ms / min(self.tuned_ms, self.default_ms)


@dataclass
class TuneReport:
    """Result of :func:`tune`: per task, plus the skipped kernels and the wall time."""

    db: str
    target: str
    results: list[TaskResult]
    skipped: list[Task] = field(default_factory=list)
    seconds: float = 0.0

    def table(self) -> str:
        """Per task: default ms, tuned ms, speedup (the faster of the two is what compile uses)."""
        lines = [f"{'task':<48} {'pattern':<14} {'space':<20} {'trials':>6} {'default ms':>11} "
                 f"{'tuned ms':>10} {'speedup':>8}  used"]
        for r in self.results:
            d = f"{r.default_ms:.4f}" if r.default_ms is not None else "failed"
            t = f"{r.tuned_ms:.4f}" if r.tuned_ms is not None else "none"
            s = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
            used = "tuned" if r.use_tuned else "default"
            lines.append(f"{r.name[:48]:<48} {r.pattern:<14} {r.space[:20]:<20} {r.trials:>6} {d:>11} "
                         f"{t:>10} {s:>8}  {used}{' (resumed)' if r.resumed else ''}")
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} kernel(s): " + ", ".join(
                f"{t.name} ({t.skip})" for t in self.skipped[:8]) + (" …" if len(self.skipped) > 8 else ""))
        lines.append(f"database {self.db} (target {self.target}), {self.seconds:.1f} s")
        return "\n".join(lines)


# ---- tasks -------------------------------------------------------------------------------------

class _Stop(Exception):
    pass


def _pre_schedule_module(mod: tvm.IRModule, spec: TargetSpec, dtype: str | None) -> tuple[
        tvm.IRModule, tvm.IRModule]:
    """(module entering ``schedule``, the ``fuse_ops`` module that names each kernel's ops)."""
    mods: dict[str, tvm.IRModule] = {}

    def keep(name: str, m: tvm.IRModule) -> None:
        mods[name] = m
        if name == PRE_SCHEDULE_STAGE:
            raise _Stop

    try:
        lower(mod, spec, dtype, on_stage=keep)
    except _Stop:
        pass
    if PRE_SCHEDULE_STAGE not in mods:
        raise TvmfuseError(f"pipeline has no stage {PRE_SCHEDULE_STAGE!r}: cannot extract tasks")
    return mods[PRE_SCHEDULE_STAGE], mods["fuse_ops"]


def extract_tasks(mod: tvm.IRModule, spec: TargetSpec, dtype: str | None = None) -> list[Task]:
    """Distinct unscheduled kernels launched by ``main`` of the fused model, in launch order."""
    pre, fuse_ops = _pre_schedule_module(mod, spec, dtype)
    groups = fused_groups(fuse_ops)
    tasks: dict[str, Task] = {}
    call_tir = tvm.ir.Op.get("relax.call_tir")
    for block in pre["main"].body.blocks:
        for binding in block.bindings:
            call = binding.value
            if not isinstance(call, relax.Call) or call.op != call_tir:
                continue
            gvar = call.args[0]
            func = pre[gvar]
            if not isinstance(func, tirx.PrimFunc):
                continue
            attention = func.attrs is not None and SPEC_ATTR in func.attrs
            if func.attrs and func.attrs.get("tirx.is_scheduled", False) and not attention:
                continue  # scheduled at legalisation, no config space
            tmod = task_module(func)
            key = task_key_of(func)
            if key in tasks:
                tasks[key].weight += 1
                continue
            ops, kinds = groups.get(gvar.name_hint, ([op_name(gvar.name_hint)], [
                int(func.attrs["op_pattern"]) if func.attrs and "op_pattern" in func.attrs else -1]))
            flops = attention_flops(str(func.attrs[SPEC_ATTR])) if attention else kernel_flops(func)
            tasks[key] = Task(gvar.name_hint, tmod, key, classify(ops, kinds), ops, flops,
                              primfunc_bytes(func))
            if spec.is_cuda:
                tasks[key].space = space_for(tmod["main"], key, spec.arch)
    return list(tasks.values())


def select_tasks(tasks: list[Task], min_gflop: float = MIN_GFLOP, min_mb: float = MIN_MB) -> list[Task]:
    """Mark each task's ``skip`` reason (None = tune it); returns the tasks to tune."""
    for t in tasks:
        if t.pattern in TUNED_PATTERNS:
            t.skip = None if t.flops >= min_gflop * 1e9 else f"{t.flops / 1e9:.3g} GFLOP < {min_gflop:g}"
        elif t.pattern == "norm":
            t.skip = None if t.bytes >= min_mb * 1e6 else f"{t.bytes / 1e6:.3g} MB < {min_mb:g}"
        else:
            t.skip = f"{t.pattern} kernel"
    return [t for t in tasks if t.skip is None]


# ---- measurement -------------------------------------------------------------------------------

def tuning_target(spec: TargetSpec) -> tvm.target.Target:
    """The target MetaSchedule searches with: the build target plus the limits its rules need."""
    if not spec.is_cuda:
        return tvm.target.Target({"kind": "llvm", "num-cores": cpu_count(logical=False)})
    return tvm.target.Target(
        {"kind": "cuda", "arch": spec.arch, "max_threads_per_block": 1024, "thread_warp_size": 32,
         # 48 KiB: what a kernel gets without opting in to more (no cudaFuncSetAttribute here)
         "max_shared_memory_per_block": 49152, "registers_per_block": 65536},
        host={"kind": "llvm"})


@derived_object
class _InProcessBuilder(ms.builder.PyBuilder):
    """MetaSchedule's default build + export, run in this process (no worker start-up)."""

    def build(self, build_inputs):
        results = []
        for inp in build_inputs:
            try:
                path = default_export(build_candidate(inp.mod, inp.target))
                results.append(ms.builder.BuilderResult(path, None))
            except Exception as err:  # one failed candidate is a result, not a crash
                results.append(ms.builder.BuilderResult(None, f"build failed: {err}"))
        return results


@derived_object
class _InProcessRunner(ms.runner.PyRunner):
    """MetaSchedule's default allocation + time evaluator, run in this process."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    def run(self, runner_inputs):
        futures = []
        for inp in runner_inputs:
            try:
                kind = str(inp.device_type)
                dev = tvm.runtime.device("cpu" if kind == "llvm" else kind, 0)
                rt_mod = tvm.runtime.load_module(str(inp.artifact_path))
                args = default_alloc_argument(dev, [a.as_json() for a in inp.args_info], 1)
                secs = default_run_evaluator(rt_mod, dev, self.config, args)
                futures.append(LocalRunnerFuture(res=secs, error_message=None))
            except Exception as err:  # noqa: BLE001 - reported as a failed candidate
                futures.append(LocalRunnerFuture(res=None, error_message=f"run failed: {err}"))
        return futures


def parse_rpc(rpc: str) -> tuple[str, int, str]:
    """``HOST:PORT:KEY`` → (host, port, key)."""
    parts = rpc.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[0] or not parts[2]:
        raise TvmfuseError(f"--rpc {rpc!r}: expected HOST:PORT:KEY, e.g. 127.0.0.1:9190:h200")
    return parts[0], int(parts[1]), parts[2]


class LocalCluster:
    """TVM's RPC tracker plus ``n`` RPC servers on loopback, one per GPU (``CUDA_VISIBLE_DEVICES``).

    ``with LocalCluster(2, "cuda") as rpc: tune(..., rpc=rpc)``; servers are TVM's own.
    """

    def __init__(self, n: int, key: str, gpus: bool = True) -> None:
        self.n, self.key, self.gpus = n, key, gpus
        self.tracker = None
        self.servers: list[Any] = []

    def __enter__(self) -> str:
        from tvm import rpc
        from tvm.rpc.tracker import Tracker

        self.tracker = Tracker("127.0.0.1", port=9190, port_end=9390, silent=True)
        previous = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            for i in range(self.n):
                if self.gpus:
                    os.environ["CUDA_VISIBLE_DEVICES"] = str(i)  # the worker process inherits it
                # no_fork: sessions start in spawned processes; a forked one inherits a CUDA
                # context it cannot use (cudaErrorInitializationError, seen on the H200 box)
                self.servers.append(rpc.Server("127.0.0.1", port=9400, port_end=9600, key=self.key,
                                               tracker_addr=("127.0.0.1", self.tracker.port),
                                               silent=True, no_fork=True))
        finally:
            if previous is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = previous
        self._wait_registered()
        return f"127.0.0.1:{self.tracker.port}:{self.key}"

    def _wait_registered(self, timeout_s: float = 60.0) -> None:
        from tvm import rpc

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                summary = rpc.connect_tracker("127.0.0.1", self.tracker.port).summary()
                if sum(s["free"] + s["pending"] for k, s in summary.get("queue_info", {}).items()
                       if k == self.key) >= self.n:
                    return
            except Exception:  # tracker still starting
                pass
            time.sleep(0.5)
        raise TvmfuseError(f"local RPC cluster: {self.n} server(s) did not register in {timeout_s:.0f} s")

    def __exit__(self, *exc: Any) -> None:
        for s in self.servers:
            s.terminate()
        if self.tracker is not None:
            self.tracker.terminate()


def _measure_setup(spec: TargetSpec, rpc: str | None, isolate: bool):
    """(builder, runner, number of measurement slots) for local, isolated or RPC measurement."""
    # CUDA: 3 repeats of ≥ 50 ms each; kernel-config searches take the fastest repeat
    config = ms.runner.EvaluatorConfig(number=3, repeat=3 if spec.is_cuda else 1,
                                       min_repeat_ms=50 if spec.is_cuda else 10,
                                       enable_cpu_cache_flush=False)
    builder = (ms.builder.LocalBuilder(max_workers=cpu_count(logical=True), timeout_sec=120.0,
                                       f_build=build_candidate)
               if isolate else _InProcessBuilder())
    if rpc:
        host, port, key = parse_rpc(rpc)
        rpc_config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key,
                                         session_timeout_sec=120)
        slots = max(1, rpc_config.count_num_servers(allow_missing=False))
        return builder, ms.runner.RPCRunner(rpc_config, config, max_workers=slots), slots
    if isolate:
        return builder, ms.runner.LocalRunner(timeout_sec=120.0, evaluator_config=config), 1
    return builder, _InProcessRunner(config), 1


def device_type(target) -> str:
    """The runner's device name for a target: ``cpu`` for llvm, else the target kind."""
    return "cpu" if target.kind.name == "llvm" else target.kind.name


def _measure_ms(mod: tvm.IRModule, target, builder, runner) -> float | None:
    """Mean run time of one built module in ms, or None if it fails to build or run."""
    return _measure_many([mod], target, builder, runner, reduce=_mean)[0][0]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _measure_many(mods: list[tvm.IRModule], target, builder, runner,
                  reduce: Callable[[list[float]], float] = min) -> list[tuple[float | None, str | None]]:
    """``(reduce(repeats) in ms, None)`` per module (default: the fastest repeat), or ``(None,
    error)`` where it fails to build or run; the builds run in the builder's workers and the runs on
    every runner slot (RPC: one per GPU)."""
    built = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
    out: list[tuple[float | None, str | None]] = [
        (None, f"build: {_last_line(b.error_msg)}") for b in built]
    inputs, where = [], []
    for i, (mod, b) in enumerate(zip(mods, built)):
        if b.artifact_path is not None:
            args = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
            inputs.append(ms.runner.RunnerInput(b.artifact_path, device_type(target), args))
            where.append(i)
    try:
        for i, fut in zip(where, runner.run(inputs) if inputs else []):
            res = fut.result()
            if not res.error_msg and res.run_secs:
                out[i] = (1e3 * reduce([float(s) for s in res.run_secs]), None)
            else:
                out[i] = (None, f"run: {_last_line(res.error_msg or 'no timing')}")
    finally:
        for b in built:
            if b.artifact_path is not None:
                shutil.rmtree(os.path.dirname(b.artifact_path), ignore_errors=True)
    return out


def _last_line(msg: str | None) -> str:
    """The informative end of a (multi-line, traceback-laden) error message."""
    lines = [ln.strip() for ln in str(msg or "").splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[-400:] if lines else "unknown error"


def _tune_configs(t: Task, target, trials: int, builder, runner, bar: _Progress) -> tuple[
        float | None, float | None, dict | None, list[dict]]:
    """Every config of ``t.space`` (at most ``trials``, the default first), built and timed in one
    batch. Returns (default ms, fastest other config's ms, that config, all timings)."""
    space = t.space
    # The default is timed first and again last: the first kernel of a batch ran slow on the
    # H200s (0.2112 ms, where the same kernel ran 0.2043 ms in the compiled model), which would
    # let any later config win; the faster of its two timings is the default's.
    cands = space.candidates[:max(1, trials)]
    cands = [*cands, cands[0]] if len(cands) > 1 else cands
    mods: list[tvm.IRModule | None] = []
    errors: list[str | None] = []
    for cfg in cands:
        try:
            mods.append(space.build(cfg))
            errors.append(None)
        except Exception as err:  # noqa: BLE001 - a config the generator refuses is a failed candidate
            mods.append(None)
            errors.append(f"generate: {_last_line(str(err))}")
    built = [m for m in mods if m is not None]
    results = iter(_measure_many(built, target, builder, runner))
    ms_of: list[float | None] = []
    for i, m in enumerate(mods):
        v, err = next(results) if m is not None else (None, errors[i])
        ms_of.append(v)
        errors[i] = err
    bar.step(len(cands), f"{t.name} configs")
    timings = [{"config": c, "ms": v} if v is not None else {"config": c, "ms": None, "error": e}
               for c, v, e in zip(cands, ms_of, errors)]
    if len(cands) > 1:  # the repeated default: merged into the first entry
        again = ms_of.pop()
        cands.pop()
        timings[0]["ms_again"] = timings.pop()["ms"]
        ms_of[0] = min((v for v in (ms_of[0], again) if v is not None), default=None)
    default_ms = ms_of[0]
    others = [(v, c) for v, c in zip(ms_of[1:], cands[1:]) if v is not None]
    if not others:
        return default_ms, None, None, timings
    best_ms, best = min(others, key=lambda p: p[0])
    return default_ms, best_ms, best, timings


def default_schedule(mod: tvm.IRModule, spec: TargetSpec) -> tvm.IRModule:
    """The kernel as ``compile`` schedules it without a database: on CUDA the sm_90a GEMM pass,
    then tvmfuse's GPU rules (the stages after ``apply_tuning_db`` in ``pipeline.lower``)."""
    if not spec.is_cuda:
        return mod
    fresh = tvm.IRModule({"main": mod["main"]})
    with spec.tvm_target():
        out = ApplyRules(*gpu_rules())(Sm90Gemm(fresh))
    return tvm.IRModule({"main": out["main"].with_attr("global_symbol", "main")})  # Sm90Gemm drops it


def build_candidate(mod: tvm.IRModule, target, params: Any = None):
    """MetaSchedule's default build without its ``import tvm.s_tir.tensor_intrin`` (see
    :func:`lazy_tensor_intrin`); TIRx kernels (sm_90a GEMM) take tvmfuse's hybrid pipeline."""
    register_tvm_patches()  # in a LocalBuilder worker too: nothing is patched on import
    if uses_tirx(mod):
        return tvm.tirx.build(mod, target=target, pipeline=HYBRID_PIPELINE)
    return tvm.tirx.build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


def lazy_tensor_intrin() -> None:
    """Make ``tvm.s_tir.tensor_intrin`` a package whose submodules load on demand.

    Its ``__init__`` parses every tensor intrinsic of every target in TVMScript (162 s of one core
    measured on the loaded 2-core CI machine; a MetaSchedule worker process that pays it on start-up
    overruns the builder's 30 s timeout). MetaSchedule's ``TuneContext`` and ``default_build`` import
    it unconditionally; with this, only ``tensor_intrin.cuda`` is loaded, and only for the
    ``cuda-tensorcore`` space. Does nothing once the package is imported.
    """
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        return
    pkg = types.ModuleType(name, "Tensor intrinsics (submodules imported on demand by tvmfuse)")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    pkg.__spec__.submodule_search_locations = pkg.__path__
    pkg.__package__ = name
    sys.modules[name] = pkg
    s_tir.tensor_intrin = pkg


# ---- search ------------------------------------------------------------------------------------

def _design_space(task: Task, spec: TargetSpec, target):
    """Union of tvmfuse's rules (``tunable=True``) and MetaSchedule's generic space."""
    if not spec.is_cuda:
        return ms.space_generator.PostOrderApply(sch_rules="llvm", postprocs="llvm",
                                                 mutator_probs="llvm")

    def rule_space(sch):
        """tvmfuse's first applicable rule; a rule that samples tile sizes gives a real space."""
        space, _ = apply_rules(sch.mod["main"], target, gpu_rules(), tunable=True)
        return list(space) if space else [sch]

    half = any(str(p.dtype) in ("float16", "bfloat16") for p in task.mod["main"].params
               if hasattr(p, "dtype"))
    kind = "cuda-tensorcore" if half and task.pattern in TUNED_PATTERNS else "cuda"
    if kind == "cuda-tensorcore":
        cuda_tensor_intrinsics()  # registers the mma/wmma intrinsics
    generic = ms.space_generator.PostOrderApply(sch_rules=kind, postprocs=kind, mutator_probs=kind)
    ours = ms.space_generator.ScheduleFn(rule_space, sch_rules=[], postprocs="cuda",
                                         mutator_probs="cuda")
    return ms.space_generator.SpaceGeneratorUnion([ours, generic], sch_rules=[], postprocs=kind,
                                                  mutator_probs=kind)


def _cost_model(cost_model: str | None) -> str:
    if cost_model is not None:
        return cost_model
    return "xgb" if importlib.util.find_spec("xgboost") else "random"


class _Progress:
    """tqdm bar over all trials when tqdm is installed, one line per task otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and importlib.util.find_spec("tqdm"):
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="trial", dynamic_ncols=True)
        self.enabled = enabled

    def step(self, n: int, desc: str) -> None:
        if self.bar is not None:
            self.bar.set_description(desc[:60])
            self.bar.update(n)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@derived_object
class _ProgressCallback(ms.measure_callback.PyMeasureCallback):
    """Each measured batch: the task's best time so far and its failures, on the progress bar."""

    def __init__(self, progress: _Progress, name: str) -> None:
        super().__init__()
        self.progress, self.name = progress, name
        self.best: list[float] = []

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        ok = [r for r in runner_results if not r.error_msg and r.run_secs]
        self.best.extend(1e3 * sum(float(s) for s in r.run_secs) / len(r.run_secs) for r in ok)
        failed = len(runner_results) - len(ok)
        self.progress.step(len(runner_results), f"{self.name} best {min(self.best):.4f} ms, {failed} failed"
                           if self.best else f"{self.name}, {failed} failed")


def _tune_task(task: Task, spec: TargetSpec, target, trials: int, builder, runner, slots: int,
               cost_model: str, progress: _Progress, seed: int):
    """MetaSchedule on one task; returns (best TuningRecord or None, trials measured)."""
    per_iter = max(1, min(trials, 64, 16 * slots))
    strategy = ms.search_strategy.EvolutionarySearch(
        population_size=max(64, 8 * per_iter), init_min_unmeasured=max(8, per_iter),
        genetic_num_iters=2)
    ctx = ms.TuneContext(task.mod, target=target, space_generator=_design_space(task, spec, target),
                         search_strategy=strategy, task_name=task.name, rand_state=seed,
                         num_threads=max(1, os.cpu_count() or 1))
    database = ms.database.MemoryDatabase()
    callbacks = ms.measure_callback.MeasureCallback.create("default") + [
        _ProgressCallback(progress, task.name)]
    with tempfile.TemporaryDirectory(prefix="tvmfuse-tune-") as work_dir:
        ms.tune_tasks(tasks=[ctx], task_weights=[1.0], work_dir=work_dir, max_trials_global=trials,
                      num_trials_per_iter=per_iter, builder=builder, runner=runner,
                      database=database, cost_model=cost_model, measure_callbacks=callbacks,
                      task_scheduler="round-robin")
    records = database.get_all_tuning_records()
    best = database.get_top_k(database.commit_workload(task.mod), 1)
    return (best[0] if best else None), len(records)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"tvmfuse": __version__}
    for pkg in ("apache-tvm", "apache-tvm-ffi", "torch"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    out["tvm_runtime"] = getattr(tvm, "__version__", None)
    return out


def _gpu_name(spec: TargetSpec) -> str | None:
    if not spec.is_cuda:
        return platform.processor() or platform.machine()
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # torch absent or no driver: the provenance says unknown
        return None


def tune(
    model: Any,
    example_inputs: tuple | None = None,
    *,
    db: str | os.PathLike,
    target: str = "sm90",
    trials: int = 64,
    dtype: str | None = None,
    inputs: dict[str, Any] | list[str] | None = None,
    rpc: str | None = None,
    gpus: int | None = None,
    min_gflop: float = MIN_GFLOP,
    min_mb: float = MIN_MB,
    cost_model: str | None = None,
    isolate: bool | None = None,
    progress: bool = True,
    seed: int = 1,
) -> TuneReport:
    """Tune the fused model's kernels that matter and write/extend the database ``db``.

    ``trials``: measured candidates per task (the default schedule is measured on top).
    ``rpc="HOST:PORT:KEY"`` measures on an RPC tracker's servers; ``gpus=N`` starts a local tracker
    with one server per GPU. ``isolate`` (default: True for CUDA) builds and runs candidates in
    worker processes. Finished tasks already in ``db`` are kept, not re-tuned (resume).
    """
    spec = get_target(target)
    lazy_tensor_intrin()
    if trials < 1:
        raise TvmfuseError(f"--trials must be at least 1, not {trials}")
    if rpc and gpus:
        raise TvmfuseError("give either --rpc or --gpus, not both")
    if gpus and importlib.util.find_spec("tornado") is None:
        # before any work: the local tracker (python -m tvm.exec.rpc_tracker) would die on import
        raise TvmfuseError("--gpus starts a local TVM RPC tracker, which needs tornado: "
                           "install tvmfuse[tune] (pip install -e \".[tune]\")")
    if dtype == "float32":
        dtype = None
    t0 = time.perf_counter()
    imported = import_model(model, example_inputs, input_overrides(inputs))
    tasks = extract_tasks(imported.mod, spec, dtype)
    chosen = select_tasks(tasks, min_gflop, min_mb)
    database = TuningDatabase.open(db, create=True)
    if database.target not in (None, spec.name):
        raise TvmfuseError(f"tuning database {db} holds target {database.target}, not {spec.name}")
    database.target = spec.name
    database.provenance = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": _gpu_name(spec), "versions": _versions(), "trials": trials, "model": str(model)
        if isinstance(model, (str, os.PathLike)) else type(model).__name__, "dtype": dtype,
        "cost_model": _cost_model(cost_model), "rpc": rpc, "gpus": gpus}
    target_obj = tuning_target(spec)
    isolate = spec.is_cuda if isolate is None else isolate
    todo = [t for t in chosen if t.key not in database.tasks]
    bar = _Progress(total=trials * len(todo), enabled=progress)
    results: list[TaskResult] = []
    for t in chosen:
        if t.key in database.tasks:
            s = database.tasks[t.key]
            results.append(TaskResult(t.name, t.pattern, s.get("default_ms"), s.get("tuned_ms"),
                                      s.get("trials", 0), s.get("seconds", 0.0), resumed=True,
                                      space=s.get("space", "metaschedule"), config=s.get("config")))
    if todo:
        if gpus:
            cluster = LocalCluster(gpus, key=f"tvmfuse-{spec.name}", gpus=spec.is_cuda)
            rpc = cluster.__enter__()
            database.provenance["rpc"] = rpc
        try:
            builder, runner, slots = _measure_setup(spec, rpc, isolate)
            for t in todo:
                results.append(_run_task(t, spec, target_obj, trials, builder, runner, slots,
                                         _cost_model(cost_model), bar, seed, database))
        finally:
            bar.close()
            if gpus:
                cluster.__exit__(None, None, None)
    return TuneReport(str(db), spec.name, results, [t for t in tasks if t.skip],
                      time.perf_counter() - t0)


def _run_task(t: Task, spec: TargetSpec, target, trials: int, builder, runner, slots: int,
              cost_model: str, bar: _Progress, seed: int, database: TuningDatabase) -> TaskResult:
    """Default measurement, search, then the atomic database write of this one task."""
    start = time.perf_counter()
    if t.space is not None:
        return _run_config_task(t, target, trials, builder, runner, bar, database, start)
    default_ms = _measure_ms(default_schedule(t.mod, spec), target, builder, runner)
    bar.note(f"{t.name} ({t.pattern}, {t.flops / 1e9:.3g} GFLOP, {t.bytes / 1e6:.3g} MB): default "
             + (f"{default_ms:.4f} ms" if default_ms is not None else "failed to build/run"))
    best, measured = _tune_task(t, spec, target, trials, builder, runner, slots, cost_model, bar, seed)
    tuned_ms = None
    if best is not None and best.run_secs:
        tuned_ms = 1e3 * sum(float(s) for s in best.run_secs) / len(best.run_secs)
        if not math.isfinite(tuned_ms) or tuned_ms >= 1e9:  # MetaSchedule's failure marker (1e10 s)
            best, tuned_ms = None, None
    result = TaskResult(t.name, t.pattern, default_ms, tuned_ms, measured, time.perf_counter() - start)
    database.finish_task(t.key, {
        "name": t.name, "pattern": t.pattern, "ops": t.ops, "flops": t.flops, "bytes": t.bytes,
        "default_ms": default_ms, "tuned_ms": tuned_ms, "use_tuned": result.use_tuned,
        "trials": measured, "seconds": round(result.seconds, 2)}, t.mod, best)
    return result


def _run_config_task(t: Task, target, trials: int, builder, runner, bar: _Progress,
                     database: TuningDatabase, start: float) -> TaskResult:
    """A kernel with a config space: all configs timed, the fastest recorded (see kernel_configs)."""
    default_ms, tuned_ms, best, timings = _tune_configs(t, target, trials, builder, runner, bar)
    space = f"configs:{t.space.kind}"
    result = TaskResult(t.name, t.pattern, default_ms, tuned_ms, len(timings),
                        time.perf_counter() - start, space=space, config=best)
    bar.note(f"{t.name} ({t.pattern}, {t.flops / 1e9:.3g} GFLOP): " + ", ".join(
        f"{_config_label(x['config'])} {x['ms']:.4f} ms" if x["ms"] is not None else
        f"{_config_label(x['config'])} failed ({x['error']})" for x in timings))
    if default_ms is None and tuned_ms is None:  # nothing ran: leave the task unfinished (a rerun
        return result                              # retries it; compile keeps the default)
    database.finish_task(t.key, {
        "name": t.name, "pattern": t.pattern, "ops": t.ops, "flops": t.flops, "bytes": t.bytes,
        "space": space, "default_config": t.space.default, "config": best,
        "default_ms": default_ms, "tuned_ms": tuned_ms, "use_tuned": result.use_tuned,
        "trials": len(timings), "seconds": round(result.seconds, 2), "candidates": timings})
    return result


def _config_label(cfg: dict) -> str:
    """Short text of a kernel config: its tile and the fields that differ from the defaults."""
    if "bm" in cfg:
        return f"{cfg['bm']}x{cfg['bn']} s{cfg['stages']} g{cfg['group_m']}"
    flags = "".join(k[0] for k in ("overlap", "pingpong", "tma_store") if cfg.get(k))
    return f"{64 * cfg['consumers']}x{cfg['block_n']} s{cfg['stages']} {flags}"
