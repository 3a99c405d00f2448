"""Shared helpers for the tvmfuse benchmarks in ``tools/bench``.

A bench script describes its workload as a :class:`Workload` (a torch module built on the CPU, its
CPU inputs, a FLOP or byte count) and hands it to :func:`bench`, which

1. compiles the module with tvmfuse, exports it and loads it (:func:`compile_and_load`),
2. checks the tvmfuse output against a float32 reference on random inputs (:func:`rel_err`,
   ``‖out − ref‖ / ‖ref‖`` in float64; above :data:`TOLERANCE` the row is marked INCORRECT),
3. times tvmfuse and the torch baselines (:func:`time_ms`, :func:`baselines`),
4. returns one result row; :func:`write_results` stores rows as one JSON object.

Throughput: TFLOP/s = FLOPs / (ms · 1e9); TB/s = bytes / (ms · 1e9).
"""

from __future__ import annotations

import argparse
import atexit
import copy
import datetime as dt
import importlib.metadata as md
import itertools
import json
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `models` and `tvmfuse` live at the repository root
    sys.path.insert(0, str(REPO))

H200_HBM_BYTES_PER_S = 4.21e12  # achievable H200 HBM3e bandwidth: memory-bound floor = bytes / this
SLOW_FIRST_RUN_MS = 50.0  # a tvmfuse call slower than this is timed with MIN_ITERS iterations
MIN_ITERS = 10
SLOW_WARMUP = 2
TOLERANCE = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-3}  # max rel_err vs fp32 reference
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ROW_KEYS = ("workload", "shape", "dtype", "target", "tvmfuse_ms", "baselines", "rel_err", "tflops",
            "tbps", "floor_ms", "speedup", "notes")  # the order of a row's first keys
ERROR_CHARS = 400  # error messages are cut to this length in rows


# ---------------------------------------------------------------------------------------------
# measurement


def default_device() -> str:
    """``cuda`` where torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync(device: str) -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# CUDA: seconds of untimed calls after the warmup, so that timing starts at the clocks a sustained
# run gets. An H100 drops from 1980 MHz to ~1600 MHz within ~0.2 s of dense GEMM work (software
# power cap, nvidia-smi at 100 ms, session 27): the 4-layer LM's prefill timed 1.405 ms right
# after an idle second and 1.55-1.59 ms from the next 60 calls on, so whichever build was timed
# first after a pause looked ~10 % faster than the same build later in the process.
SETTLE_S = 0.5


def settle(fn: Callable[[], Any], device: str, seconds: float) -> int:
    """Call ``fn`` back to back, 10 calls between synchronizations, until ``seconds`` passed (at
    least once when ``seconds`` > 0); returns the calls made (:data:`SETTLE_S`)."""
    calls, start = 0, time.perf_counter()
    while seconds > 0 and (calls == 0 or time.perf_counter() - start < seconds):
        for _ in range(10):  # back to back, as timed; the sync keeps the host with the GPU
            fn()
        calls += 10
        sync(device)
    return calls


def time_stats(
    fn: Callable[[], Any], warmup: int = 10, iters: int = 50, device: str | None = None,
    settle_s: float = SETTLE_S,
) -> tuple[float, float]:
    """``(median ms per call, wall ms per call)`` of ``fn()`` after ``warmup`` untimed calls
    (on CUDA also after ``settle_s`` seconds of them: :data:`SETTLE_S`).

    CUDA: one ``torch.cuda.Event`` pair per iteration on the current stream (the median of the
    per-iteration device times). CPU: ``time.perf_counter`` around each call. The wall figure is
    the whole timed loop (with a final synchronize) divided by ``iters``; it cross-checks that
    the events saw the work. ``device`` defaults to :func:`default_device`.
    """
    device = device or default_device()
    for _ in range(warmup):
        fn()
    sync(device)
    if device.startswith("cuda"):
        settle(fn, device, settle_s)
    times: list[float] = []
    start_wall = time.perf_counter()
    if device.startswith("cuda"):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for start, end in zip(starts, ends, strict=True):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    wall = (time.perf_counter() - start_wall) * 1e3 / iters
    return statistics.median(times), wall


def time_ms(
    fn: Callable[[], Any], warmup: int = 10, iters: int = 50, device: str | None = None
) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup`` runs."""
    return time_stats(fn, warmup, iters, device)[0]


def kernel_us(fn: Callable[[int], Any], iters: int) -> float:
    """Mean GPU time (µs) of the kernels one ``fn(i)`` launches (i = 0 .. iters − 1), from the
    profiler: the kernels' own durations, without the host's launch cost between calls (what a
    CUDA-graph replay sees). ``fn`` is called a few times first to warm up."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(i)
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0
                and not e.key.startswith(("cudaDeviceSynchronize", "Activity Buffer")))
    return total / iters


def _flat64(out: Any) -> torch.Tensor:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return torch.cat([o.detach().reshape(-1).to(torch.float64) for o in outs])


def rel_err(out: Any, ref: Any) -> float:
    """``‖out − ref‖₂ / ‖ref‖₂`` in float64 (tensors or tuples of tensors, any float dtype)."""
    a, b = _flat64(out), _flat64(ref)
    if a.shape != b.shape:
        raise ValueError(f"output has {a.numel()} elements, the reference {b.numel()}")
    return float(torch.linalg.vector_norm(a.to(b.device) - b) / torch.linalg.vector_norm(b))


def reference_output(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> Any:
    """``fn`` evaluated in float32 (a float32 copy of a module, float32 inputs, no TF32)."""
    if isinstance(fn, torch.nn.Module):
        fn = copy.deepcopy(fn).float()
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            return fn(*[x.float() if x.is_floating_point() else x for x in inputs])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


# ---------------------------------------------------------------------------------------------
# environment


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def _module_version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except Exception:  # not installed, or broken: report as unknown
        return None


def versions() -> dict[str, str | None]:
    """Versions of python, tvm, torch, CUDA (torch's), triton and tvmfuse.

    TVM is unpacked onto PYTHONPATH on the GPU machine, where ``importlib.metadata`` does not see
    it: ``tvm.__version__`` is the fallback (likewise for tvmfuse, which is not installed there).
    """
    return {
        "python": platform.python_version(),
        "tvm": _dist_version("apache-tvm") or _module_version("tvm"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _dist_version("triton", "pytorch-triton") or _module_version("triton"),
        "tvmfuse": _module_version("tvmfuse") or _dist_version("tvmfuse"),
    }


def gpu_name() -> str:
    """The CUDA device name, or ``cpu (<machine>)`` where torch sees no GPU."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()})"


def command_line() -> str:
    """This process's command line, shell-quoted."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def short_error(err: BaseException) -> str:
    """``Type: message`` on one line, cut to ERROR_CHARS characters."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


# ---------------------------------------------------------------------------------------------
# results


def write_results(
    path: str | Path, rows: list[dict[str, Any]], command: str, append: bool = False
) -> Path:
    """Write ``{"date", "gpu", "versions", "command", "rows"}`` as one JSON object to ``path``.

    ``append``: keep the rows of an existing results file at ``path`` in front of ``rows``.
    """
    path = Path(path)
    old: list[dict[str, Any]] = []
    if append and path.is_file():
        try:
            old = list(json.loads(path.read_text()).get("rows", []))
        except (json.JSONDecodeError, AttributeError) as err:
            print(f"warning: {path} is not a results file ({err}); overwriting it", file=sys.stderr)
    doc = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu_name(),
        "versions": versions(),
        "command": command,
        "rows": old + rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f}" if ms < 100 else f"{ms:.1f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A compact text table: ms, throughput and speedup (baseline ms / tvmfuse ms) per row."""
    lines = [
        f"{'workload':<16} {'dtype':<8} {'tvmfuse ms':>10} {'rate':>12}  "
        f"{'baselines ms (baseline/tvmfuse)':<58} {'rel_err':>8}  notes"
    ]
    for row in rows:
        rate_key, unit = ("tflops", "TF/s") if "tflops" in row else ("tbps", "TB/s")
        rate = (row.get(rate_key) or {}).get("tvmfuse")
        speedup = row.get("speedup") or {}
        parts = []
        for key, ms in (row.get("baselines") or {}).items():
            name = key.removesuffix("_ms").removeprefix("torch_")
            ratio = speedup.get(key.removesuffix("_ms"))
            parts.append(f"{name} {_fmt_ms(ms)}" + (f" ({ratio:.2f}x)" if ratio else ""))
        if row.get("floor_ms") is not None:
            parts.append(f"HBM floor {_fmt_ms(row['floor_ms'])}")
        err = row.get("rel_err")
        lines.append(
            f"{row.get('workload', '?'):<16} {row.get('dtype', ''):<8} "
            f"{_fmt_ms(row.get('tvmfuse_ms')):>10} "
            f"{'-' if rate is None else f'{rate:.3g} {unit}':>12}  {', '.join(parts):<58} "
            f"{'-' if err is None else f'{err:.1e}':>8}  {row.get('notes', '')}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# compilation

_counter = itertools.count()


def compile_and_load(
    module: torch.nn.Module | str,
    example_inputs: tuple[torch.Tensor, ...],
    target: str,
    workdir: str | Path,
    name: str = "model",
    options: Any = None,
    tuning_db: str | None = None,
) -> tuple[Callable[..., Any], float]:
    """``tvmfuse.compile`` → ``export`` into ``workdir`` → ``tvmfuse.load``; returns
    ``(callable, compile seconds)`` (compile + export, not load). ``options``: a
    ``tvmfuse.Options`` (None: the defaults); ``tuning_db``: a ``tvmfuse tune`` database.

    Each call writes a new file name: a path that was loaded once stays cached by ``dlopen``.
    """
    import tvmfuse

    t0 = time.perf_counter()
    lib = tvmfuse.compile(module, example_inputs, target=target, options=options,
                          tuning_db=tuning_db)
    path = lib.export(Path(workdir) / f"{name}_{next(_counter)}.so")
    seconds = time.perf_counter() - t0
    return tvmfuse.load(path, device="cpu" if target == "cpu" else "cuda"), seconds


# ---------------------------------------------------------------------------------------------
# baselines


def baselines(
    fn_eager: Callable[..., Any],
    inputs: Sequence[torch.Tensor],
    *,
    extra: dict[str, Callable[..., Any]] | None = None,
    use_compile: bool = True,
    warmup: int = 10,
    iters: int = 50,
    device: str | None = None,
    callables: dict[str, Callable[..., Any]] | None = None,
) -> dict[str, Any]:
    """Median ms of ``fn_eager(*inputs)`` (``torch_eager_ms``), of ``torch.compile(fn_eager)``
    (``torch_compile_ms``, default mode, warmed up) and of each ``extra`` callable (its key, e.g.
    ``cublas_ms``). A failing baseline is ``None`` and its error goes under ``"errors"``;
    ``"torch_compile_s"`` is the first compiled call's wall time. ``callables`` (when given)
    receives each timed baseline's function under its key, for :func:`interleaved`.
    """
    device = device or default_device()
    result: dict[str, Any] = {"torch_eager_ms": None, "torch_compile_ms": None}
    errors: dict[str, str] = {}

    def measure(key: str, fn: Callable[..., Any]) -> None:
        try:
            result[key] = time_ms(lambda: fn(*inputs), warmup, iters, device)
            if callables is not None:
                callables[key] = fn
        except Exception as err:  # a baseline failing must not stop the run
            errors[key.removesuffix("_ms")] = short_error(err)

    with torch.no_grad():
        measure("torch_eager_ms", fn_eager)
        if use_compile:
            try:
                torch._dynamo.reset()
                compiled = torch.compile(fn_eager)
                t0 = time.perf_counter()
                compiled(*inputs)
                sync(device)
                result["torch_compile_s"] = round(time.perf_counter() - t0, 2)
                measure("torch_compile_ms", compiled)
            except Exception as err:
                errors["torch_compile"] = short_error(err)
        else:
            errors["torch_compile"] = "skipped (--no-compile)"
        for key, fn in (extra or {}).items():
            result[key] = None
            measure(key, fn)
    if errors:
        result["errors"] = errors
    return result


# ---------------------------------------------------------------------------------------------
# the benchmark of one workload


@dataclass
class Workload:
    """One benchmark: what tvmfuse compiles, what torch runs, and the work it does.

    ``module`` and ``inputs`` are built on the CPU (tvmfuse compiles them there) and moved to the
    bench device afterwards. ``eager`` is the torch baseline (default: ``module``) and, run in
    float32, the correctness reference. ``extra`` holds further eager baselines by row key
    (``cublas_ms``, ``sdpa_ms``), called with ``inputs``. ``export``, when set, writes the model
    file tvmfuse compiles instead of ``module`` (e.g. its ONNX export) into the given folder.
    """

    name: str
    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    shape: str
    dtype: str
    flops: float | None = None
    bytes: float | None = None
    eager: torch.nn.Module | None = None
    extra: dict[str, Callable[..., Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    export: Callable[[Path], str] | None = None


def random_inputs(
    shapes: Sequence[Sequence[int]], dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Standard-normal CPU tensors (never all zero), one per shape, reproducible by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)
                 for shape in shapes)


def _rates(row: dict[str, Any], wl: Workload) -> None:
    """Throughput of tvmfuse and every timed baseline, and the speedups of a correct tvmfuse."""
    times = {"tvmfuse": row["tvmfuse_ms"]}
    times.update({k.removesuffix("_ms"): v for k, v in row["baselines"].items()})
    for key, work in (("tflops", wl.flops), ("tbps", wl.bytes)):
        if work:  # FLOPs / (ms · 1e9) = TFLOP/s; bytes / (ms · 1e9) = TB/s
            row[key] = {k: (_sig(work / (ms * 1e9)) if ms else None) for k, ms in times.items()}
    if wl.bytes:
        row["floor_ms"] = _sig(wl.bytes / H200_HBM_BYTES_PER_S * 1e3)
    tv = row["tvmfuse_ms"]
    correct = tv is not None and "INCORRECT" not in row["notes"]
    row["speedup"] = {k: (_sig(ms / tv) if correct and ms else None)
                      for k, ms in times.items() if k != "tvmfuse"}


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits."""
    return float(f"{x:.{digits}g}")


def _time_tvmfuse(
    fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], opts: argparse.Namespace,
    notes: list[str],
) -> tuple[float, float, int]:
    """Median and wall ms of a tvmfuse call; slow ones (> SLOW_FIRST_RUN_MS) get MIN_ITERS."""
    fn(*inputs)  # first call: lazy module loading, CUDA-graph capture
    sync(opts.device)
    t0 = time.perf_counter()
    fn(*inputs)
    sync(opts.device)
    first_ms = (time.perf_counter() - t0) * 1e3
    warmup, iters = opts.warmup, opts.iters
    if first_ms > SLOW_FIRST_RUN_MS and iters > MIN_ITERS:
        warmup, iters = SLOW_WARMUP, MIN_ITERS
        notes.append(f"tvmfuse {first_ms:.0f} ms/call: timed {iters} iters")
    median, wall = time_stats(lambda: fn(*inputs), warmup, iters, opts.device)
    if opts.device.startswith("cuda") and median < 0.5 * wall:
        notes.append(f"event median {median:.3f} ms << wall {wall:.3f} ms/call: check streams")
    return median, wall, iters


def bench(wl: Workload, opts: argparse.Namespace) -> dict[str, Any]:
    """Compile, check and time ``wl`` with tvmfuse and its torch baselines; one result row."""
    notes = list(wl.notes)
    row: dict[str, Any] = {
        "workload": wl.name, "shape": wl.shape, "dtype": wl.dtype, "target": opts.target,
        "tvmfuse_ms": None, "baselines": {}, "rel_err": None, "notes": "",
    }
    log = _logger(wl.name)
    fn = None
    try:
        model = wl.export(Path(opts.workdir)) if wl.export else wl.module
        fn, row["compile_s"] = compile_and_load(model, wl.inputs, opts.target, opts.workdir,
                                                wl.name)
        log(f"tvmfuse compile + export {row['compile_s']:.1f} s")
    except Exception as err:
        notes.append(f"tvmfuse compile failed: {short_error(err)}")
        log(notes[-1])

    built = _compile_variants(wl, opts, log)  # before the module moves to the device
    eager = (wl.eager or wl.module).to(opts.device)  # the baseline and float32 reference
    inputs = tuple(x.to(opts.device).contiguous() for x in wl.inputs)
    ref = reference_output(eager, inputs)
    with torch.no_grad():
        row["eager_rel_err"] = rel_err(eager(*inputs), ref)

    if fn is not None:
        try:
            out = fn(*inputs)
            row["rel_err"] = rel_err(out, ref)
            outs = out if isinstance(out, tuple) else (out,)
            dtypes = sorted({str(o.dtype).removeprefix("torch.") for o in outs})
            if dtypes != [wl.dtype]:
                notes.append(f"output dtype {','.join(dtypes)} (inputs {wl.dtype})")
            del out, outs
            tol = TOLERANCE[wl.dtype]
            if not row["rel_err"] <= tol:  # also catches NaN
                notes.insert(0, f"INCORRECT (rel_err > {tol:g})")
            row["tvmfuse_ms"], row["tvmfuse_wall_ms"], row["iters"] = _time_tvmfuse(
                fn, inputs, opts, notes)
            log(f"tvmfuse {row['tvmfuse_ms']:.3f} ms, rel_err {row['rel_err']:.2e}")
        except Exception as err:
            notes.append(f"tvmfuse run failed: {short_error(err)}")
            log(notes[-1])
    # --rounds keeps the builds for the interleaved timing; else they go before the baselines
    kept: dict[str, Callable[..., Any]] = {}
    if getattr(opts, "rounds", 0):
        kept = ({"tvmfuse": fn} if fn is not None else {}) | {
            n: f for n, (_, f) in built.items() if f is not None}
    del fn
    variants = _time_variants(built, opts, inputs, ref, wl.dtype, log)
    del ref, built

    timed: dict[str, Callable[..., Any]] = {}
    base = baselines(eager, inputs, extra=wl.extra, use_compile=not opts.no_compile, callables=timed,
                     warmup=opts.warmup, iters=opts.iters, device=opts.device)
    if "torch_compile_s" in base:
        row["torch_compile_s"] = base.pop("torch_compile_s")
    errors = base.pop("errors", {})
    row["baselines"] = base
    if errors:
        row["errors"] = errors
        notes += [f"{k}: {v}" for k, v in errors.items() if not v.startswith("skipped")]
    row["notes"] = "; ".join(notes)
    _rates(row, wl)
    for v in variants.values():  # the same baselines as the default build, same process
        ms = v.get("ms")
        v["speedup"] = {k.removesuffix("_ms"): (_sig(b / ms) if ms and b else None)
                        for k, b in base.items()}
    if variants:
        row["variants"] = variants
    if kept:
        fns = kept | {k.removesuffix("_ms"): f for k, f in timed.items()}
        runs = interleaved({n: (lambda f=f: f(*inputs)) for n, f in fns.items()}, opts.rounds,
                           opts.warmup, opts.iters, opts.device)
        medians = {n: statistics.median(v) for n, v in runs.items()}
        row["interleaved"] = {"rounds": runs, "median_ms": medians, "speedup": {
            n: {b: _sig(medians[b] / medians[n]) for b in medians if b.startswith("torch_")}
            for n in medians if not n.startswith("torch_")}}
        log("interleaved medians " + ", ".join(f"{n} {m:.4f}" for n, m in medians.items()))
    log("baselines " + ", ".join(f"{k} {_fmt_ms(v)}" for k, v in base.items()))
    first = [k for k in ROW_KEYS if k in row]
    return {k: row[k] for k in first} | {k: v for k, v in row.items() if k not in first}


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME=FIELD:VALUE[,FIELD:VALUE…]`` → (name, Options fields); values are JSON literals
    (``true``, ``8``, ``"all"``) or else strings: ``pdl=programmatic_launch:all,cuda_graph:true``.
    The field ``tuning_db:PATH`` is not an Options field: that build reads the ``tvmfuse tune``
    database PATH."""
    name, sep, fields = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant {text!r}: expected NAME=FIELD:VALUE[,FIELD:VALUE...]")
    out: dict[str, Any] = {}
    for item in filter(None, fields.split(",")):
        key, sep, value = item.partition(":")
        if not sep:
            raise SystemExit(f"--variant {text!r}: {item!r} is not FIELD:VALUE")
        if value in ("True", "False", "None"):  # Python spellings: "False" would be a truthy str
            out[key] = {"True": True, "False": False, "None": None}[value]
            continue
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return name, out


def _compile_variants(wl: Workload, opts: argparse.Namespace, log: Callable[[str], None],
                      ) -> dict[str, tuple[dict[str, Any], Callable[..., Any] | None]]:
    """Each ``--variant`` compiled with its Options fields: name → (result entry, callable)."""
    from tvmfuse.options import Options

    built: dict[str, tuple[dict[str, Any], Callable[..., Any] | None]] = {}
    for text in getattr(opts, "variant", None) or []:
        name, fields = parse_variant(text)
        entry: dict[str, Any] = {"options": fields}
        fields = dict(fields)
        db = fields.pop("tuning_db", None)
        fn = None
        try:
            model = wl.export(Path(opts.workdir)) if wl.export else wl.module
            fn, entry["compile_s"] = compile_and_load(model, wl.inputs, opts.target, opts.workdir,
                                                      f"{wl.name}_{name}", Options(**fields), db)
        except Exception as err:
            entry["notes"] = f"compile failed: {short_error(err)}"
            log(f"variant {name}: {entry['notes']}")
        built[name] = (entry, fn)
    return built


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int, iters: int,
                device: str) -> dict[str, list[float]]:
    """Median ms of each ``fns`` entry in each of ``rounds`` rounds, every entry timed once a
    round in turn (A B C A B C …): a drift of the GPU over the run (clocks, temperature) then
    reaches every entry alike instead of the ones timed last."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    with torch.no_grad():
        for _ in range(rounds):
            for name, fn in fns.items():
                out[name].append(time_ms(fn, warmup, iters, device))
    return out


def _time_variants(built: dict[str, tuple[dict[str, Any], Callable[..., Any] | None]],
                   opts: argparse.Namespace, inputs: tuple[torch.Tensor, ...], ref: Any,
                   dtype: str, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Each compiled variant checked against ``ref`` and timed in this process (so its ratios to
    the baselines share their run); name → result entry."""
    results: dict[str, dict[str, Any]] = {}
    for name, (entry, fn) in built.items():
        results[name] = entry
        if fn is None:
            continue
        try:
            entry["rel_err"] = rel_err(fn(*inputs), ref)
            if not entry["rel_err"] <= TOLERANCE[dtype]:
                entry["notes"] = "INCORRECT"
            entry["ms"], entry["wall_ms"], _ = _time_tvmfuse(fn, inputs, opts, [])
            log(f"variant {name}: {entry['ms']:.4f} ms, rel_err {entry['rel_err']:.2e}")
        except Exception as err:
            entry["notes"] = f"run failed: {short_error(err)}"
            log(f"variant {name}: {entry['notes']}")
    return results


def _logger(name: str) -> Callable[[str], None]:
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{name} +{time.perf_counter() - start:.0f}s] {msg}", file=sys.stderr, flush=True)

    return log


# ---------------------------------------------------------------------------------------------
# command line


def parser(description: str | None) -> argparse.ArgumentParser:
    """The options every bench script (and run_all) takes."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=["sm90", "sm80"], default="sm90",
                   help="tvmfuse target (default sm90); --device cpu forces target cpu")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: full shapes; cpu: tiny smoke shapes, target cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="float16")
    p.add_argument("--iters", type=int, default=50, help="timed iterations (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations (default 10)")
    p.add_argument("--dry-run", action="store_true", help="same as --device cpu")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--rounds", type=int, default=0,
                   help="then time the build, its variants and the baselines again in this many "
                        "interleaved rounds (A B C A B C …; medians under 'interleaved')")
    p.add_argument("--out", help="results JSON file (a bench script appends its rows to it)")
    p.add_argument("--workdir", help="where the .so files go (default: a temporary directory)")
    p.add_argument("--variant", action="append", metavar="NAME=FIELD:VALUE[,...]",
                   help="also build tvmfuse with these tvmfuse.Options fields and time it in the "
                        "same process, e.g. pdl=programmatic_launch:all (repeatable)")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Apply ``--device cpu`` (target cpu) and make a work directory removed at exit."""
    if args.dry_run:
        args.device = "cpu"
    if args.device == "cpu":
        args.target = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU; use --device cpu for a smoke run")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    if not args.workdir:
        args.workdir = tempfile.mkdtemp(prefix="tvmfuse-bench-")
        atexit.register(shutil.rmtree, args.workdir, True)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    return args


def main(run: Callable[[argparse.Namespace], list[dict[str, Any]]], description: str | None,
         extend: Callable[[argparse.ArgumentParser], Any] | None = None) -> int:
    """CLI of one bench script: run, print the JSON and the table, append to ``--out``.
    ``extend(parser)`` adds the script's own options.

    Exits 0 when the script ran: tvmfuse failures and INCORRECT results are data in the rows.
    """
    p = parser(description)
    if extend is not None:
        extend(p)
    args = resolve(p.parse_args())
    rows = run(args)
    print(json.dumps({"gpu": gpu_name(), "versions": versions(), "rows": rows}, indent=1))
    print(format_table(rows))
    if args.out:
        path = write_results(args.out, rows, command_line(), append=True)
        print(f"appended {len(rows)} row(s) to {path}")
    return 0


def model_workload(name: str, build: Callable[..., Any], size: dict[str, int], dtype: str,
                   flops: float) -> Workload:
    """A ``models/`` module built at ``size`` (random init, seed 0) as a Workload."""
    module, inputs = build(**size, dtype=DTYPES[dtype], seed=0)
    return Workload(name=name, module=module, inputs=inputs,
                    shape=" ".join(f"{k}={v}" for k, v in size.items()), dtype=dtype, flops=flops)
