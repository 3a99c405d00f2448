"""ONNX backend node tests through tvmfuse's public API on the cpu target.

    python tools/onnx_conformance.py [--only SUBSTR] [--subset ci|full] [-j N] [--timeout S]
                                     [--update] [--report OUT.json] [--target sm90 --float-only]

Every node test of the installed onnx (``onnx.backend.test.loader.load_model_tests(kind="node")``,
materialised in memory; no data is checked in) is compiled with ``tvmfuse.compile(model,
target="cpu", inputs=...)`` (declared dynamic dims fixed to the test's concrete input shapes),
loaded with ``.load("cpu")`` and called with the test's numpy inputs. Floats are compared with
rtol 1e-3 / atol 1e-4 (or the test's own looser tolerance; 4 ulps for fp16/bf16 outputs), ints
and bools exactly; shapes and dtypes must match. Each test runs in a forked child (the parent
has imported and warmed up TVM once) under a timeout, so a segfault or hang is recorded
instead of killing the run. ``--target sm90`` (on the GPU machine) compiles for that target and
calls the library with torch tensors on the GPU; ``--float-only`` keeps the tests whose inputs
and outputs are all floating point (the GPU half of the issue: the cpu pass set minus ≤ 2%).

A test's status is ``pass``, ``wrong`` (ran, different answer), ``refused`` (a tvmfuse error) or
``crash`` (any other exception, a signal, a timeout). Tests a tensor compiler cannot be asked to
pass carry an ``excluded`` reason (:func:`exclusion`) and do not count toward the pass rate; they
still must not crash or answer wrongly.

``--update`` rewrites the expected-status file ``tests/data/onnx_node_status.json`` and the
coverage table ``docs/onnx_coverage.md`` from the run (full set only).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import select
import signal
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STATUS_FILE = ROOT / "tests" / "data" / "onnx_node_status.json"
COVERAGE_FILE = ROOT / "docs" / "onnx_coverage.md"
RTOL, ATOL = 1e-3, 1e-4
STATUSES = ("pass", "wrong", "crash", "refused")

# TensorProto elem types a tensor compiler is not asked to hold at the model boundary.
_EXCLUDED_ELEM = {8: "string", 14: "complex64", 15: "complex128", 17: "float8e4m3fn",
                  18: "float8e4m3fnuz", 19: "float8e5m2", 20: "float8e5m2fnuz", 21: "uint4",
                  22: "int4", 23: "float4e2m1", 24: "float8e8m0", 25: "uint2", 26: "int2"}
_RANDOM_OPS = {"Bernoulli", "RandomNormal", "RandomNormalLike", "RandomUniform",
               "RandomUniformLike", "Multinomial"}
_EXPANDED = re.compile(r"_expanded(_ver\d+)?$")


@dataclass
class Case:
    """One node test: its name, model and a single data set."""

    name: str
    model: Any  # onnx.ModelProto
    inputs: list
    outputs: list
    rtol: float
    atol: float


def load_cases() -> list[Case]:
    """The installed onnx's node tests, in name order."""
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tests = load_model_tests(kind="node")
    cases = []
    for t in sorted(tests, key=lambda t: t.name):
        ins, outs = t.data_sets[0]
        cases.append(Case(t.name, t.model, [_array(x) for x in ins], [_array(x) for x in outs],
                          t.rtol, t.atol))
    return cases


def _array(value: Any) -> Any:
    """A test's TensorProto as numpy (as onnx's backend runner does); anything else unchanged."""
    from onnx import TensorProto, numpy_helper

    return numpy_helper.to_array(value) if isinstance(value, TensorProto) else value


def _nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _nodes(attr.g)
            for g in attr.graphs:
                yield from _nodes(g)


def exclusion(case: Case) -> str | None:
    """Why the issue's definition leaves ``case`` out of the pass rate, or None when it counts."""
    graph = case.model.graph
    for node in _nodes(graph):
        if node.domain not in ("", "ai.onnx"):
            return f"non-default domain {node.domain}"
        if node.op_type in _RANDOM_OPS:
            return f"random output ({node.op_type})"
    for value in list(graph.input) + list(graph.output):
        kind = value.type.WhichOneof("value")
        if kind != "tensor_type":
            return f"non-tensor {'input' if value in graph.input else 'output'} ({kind})"
        elem = value.type.tensor_type.elem_type
        if elem in _EXCLUDED_ELEM:
            return f"{_EXCLUDED_ELEM[elem]} I/O"
    return None


def is_float_case(case: Case) -> bool:
    """Every input and output a floating-point numpy array (sequences and maps are not)."""
    return all(isinstance(a, np.ndarray | np.generic) and a.dtype.kind == "f"
               for a in [*case.inputs, *case.outputs])


def op_of(case: Case, by_name: dict[str, Case]) -> str:
    """The operator a test is about: its one node, or the op of its non-expanded twin."""
    base = _EXPANDED.sub("", case.name)
    if base != case.name and base in by_name:
        return op_of(by_name[base], by_name)
    ops = [n.op_type for n in case.model.graph.node]
    if len(set(ops)) == 1:
        return ops[0]
    return ops[-1] if ops else "?"


def _overrides(case: Case) -> dict[str, tuple[int, ...]]:
    """Concrete shapes for inputs whose declared shape has a dynamic or missing dimension."""
    import numpy as np

    init = {t.name for t in case.model.graph.initializer}
    graph_inputs = [i for i in case.model.graph.input if i.name not in init]
    result = {}
    for value, array in zip(graph_inputs, case.inputs):
        ttype = value.type.tensor_type
        static = ttype.HasField("shape") and all(
            d.HasField("dim_value") and d.dim_value > 0 for d in ttype.shape.dim)
        if not static and isinstance(array, (np.ndarray, np.generic)):
            result[value.name] = tuple(array.shape)
    return result


def _compare(got: list, want: list, rtol: float, atol: float) -> str | None:
    """None when every output matches, else what differs first."""
    import numpy as np

    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return f"output {i}: shape {g.shape}, expected {w.shape}"
        if g.dtype != w.dtype:
            return f"output {i}: dtype {g.dtype}, expected {w.dtype}"
        if w.dtype.kind in "fc" or w.dtype.name == "bfloat16":
            gf, wf = g.astype(np.float64), w.astype(np.float64)
            if not np.allclose(gf, wf, rtol=rtol, atol=atol, equal_nan=True):
                bad = int((~np.isclose(gf, wf, rtol=rtol, atol=atol, equal_nan=True)).sum())
                return f"output {i}: {bad}/{w.size} elements differ beyond rtol {rtol} atol {atol}"
        elif not np.array_equal(g, w):
            return f"output {i}: {int((g != w).sum())}/{w.size} elements differ"
    return None


def _tolerance(case: Case) -> tuple[float, float]:
    """rtol 1e-3 / atol 1e-4, the test's own if looser, and 4 ulps of a half-precision output
    (one fp16 ulp is 1e-3 relative, one bf16 ulp 8e-3: a single rounding apart would fail)."""
    rtol, atol = max(case.rtol, RTOL), max(case.atol, ATOL)
    for out in case.outputs:
        name = getattr(getattr(out, "dtype", None), "name", "")
        if name in ("float16", "bfloat16"):
            ulp = 2.0 ** -10 if name == "float16" else 2.0 ** -7
            rtol, atol = max(rtol, 4 * ulp), max(atol, 4 * ulp)
    return rtol, atol


def run_case(case: Case, workdir: str, target: str = "cpu",
             compile_only: bool = False) -> tuple[str, str]:
    """(status, detail) of one test, run in this process (CUDA targets: inputs and outputs go
    through torch tensors on the GPU). ``compile_only``: compile and export (nvcc for CUDA
    targets, so a CPU machine finds what a target cannot build) and stop: "pass" means built."""
    import tvmfuse
    from tvmfuse.errors import TvmfuseError

    try:
        lib = tvmfuse.compile(case.model, target=target, inputs=_overrides(case) or None)
        if compile_only:
            lib.export(Path(workdir) / "model.so")
            return "pass", "compiled"
        if target == "cpu":
            model = lib.load("cpu", workdir=workdir)
            out = model(*case.inputs)
        else:
            import torch

            model = lib.load("cuda", workdir=workdir)
            # np.require keeps a 0-d input 0-d (np.ascontiguousarray makes it 1-d)
            out = model(*(torch.from_numpy(np.require(x, requirements="C")).cuda() for x in case.inputs))
            out = tuple(o.cpu().numpy() for o in out) if isinstance(out, tuple | list) else \
                out.cpu().numpy()
    except TvmfuseError as err:
        return "refused", f"{type(err).__name__}: {err}"
    except BaseException as err:  # noqa: BLE001 - anything else is what this run looks for
        tb = traceback.extract_tb(err.__traceback__)[-1]
        return "crash", f"{type(err).__name__}: {err} (at {Path(tb.filename).name}:{tb.lineno})"
    outs = list(out) if isinstance(out, tuple) else [out]
    rtol, atol = _tolerance(case)
    why = _compare(outs, case.outputs, rtol, atol)
    return ("wrong", why) if why else ("pass", "")


def _warm_up() -> None:
    """Import and exercise the compiler once, so forked children start warm."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    import tvmfuse

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "warm", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)])
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tvmfuse.compile(model, target="cpu").export(Path(tmp) / "warm.so")
    np.zeros(1)


def _child(case: Case, workdir: str, target: str, compile_only: bool, w: int | str) -> None:
    """In a child process: run ``case``, write the pickled result to fd (or file) ``w``, exit."""
    code = 0
    try:
        sys.stdout.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        result = run_case(case, workdir, target, compile_only)
        with (os.fdopen(w, "wb") if isinstance(w, int) else open(w + ".part", "wb")) as f:
            f.write(pickle.dumps(result))
        if isinstance(w, str):
            os.replace(w + ".part", w)
    except BaseException:  # noqa: BLE001 - the child must never return into the parent's code
        code = 1
    os._exit(code)


def _fork(case: Case, workdir: str, target: str, compile_only: bool, server) -> tuple[int, int, Any]:
    """Start ``case`` in a child; returns (pid, an fd readable when it is done, its forkserver
    Process or None). CPU
    runs fork this warm process (the result comes through a pipe); a GPU run starts children
    from ``server``, a forkserver whose process never touched CUDA (a CUDA context does not
    survive a fork, and importing torch or the compiler may initialise the driver): its child
    writes the result to ``workdir/result.pkl``, and the fd is the Process's sentinel."""
    if server is None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(case, workdir, target, compile_only, w)
        os.close(w)
        return pid, r, None
    proc = server.Process(target=_child, args=(case, workdir, target, compile_only,
                                               os.path.join(workdir, "result.pkl")))
    proc.start()
    return proc.pid, proc.sentinel, proc


def run_cases(cases: list[Case], jobs: int = 1, timeout: float = 60.0, progress: bool = False,
              target: str = "cpu", compile_only: bool = False,
              deadline: float | None = None) -> dict[str, dict[str, str]]:
    """Run ``cases`` in children, ``jobs`` at a time; name → {"status", "detail"}. The parent
    never touches the GPU: each child opens its own context. After ``deadline`` seconds no new
    case starts (a device call has a hard limit): the ones left are returned as ``not run``."""
    import multiprocessing
    import tempfile

    server = None
    if target != "cpu" and not compile_only:
        server = multiprocessing.get_context("forkserver")
        # numpy and onnx only: on the H200 a forkserver that had imported tvm/torch/tvmfuse still
        # handed its children a dead CUDA context (cudaErrorInitializationError in every child)
        server.set_forkserver_preload(["numpy", "onnx"])
    else:
        _warm_up()
    results: dict[str, dict[str, str]] = {}
    pending = list(reversed(cases))
    running: dict[int, tuple[Case, int, float, bytearray, Any]] = {}  # fd → case, pid, start,
    # data, forkserver Process (None for a forked child; a Process owns its sentinel fd)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tvmfuse-onnx-") as tmp:
        while pending or running:
            if pending and deadline is not None and time.monotonic() - began > deadline:
                results.update({c.name: {"status": "not run", "detail": f"deadline {deadline:.0f} s"}
                                for c in pending})
                pending.clear()
            while pending and len(running) < jobs:
                case = pending.pop()
                workdir = os.path.join(tmp, case.name)
                os.makedirs(workdir)
                pid, fd, proc = _fork(case, workdir, target, compile_only, server)
                running[fd] = (case, pid, time.monotonic(), bytearray(), proc)
            ready, _, _ = select.select(list(running), [], [], 0.5)
            now = time.monotonic()
            for fd in list(running):
                case, pid, start, data, proc = running[fd]
                if fd in ready and proc:
                    status, detail = _reap_served(proc, os.path.join(tmp, case.name, "result.pkl"))
                elif fd in ready:
                    chunk = os.read(fd, 1 << 16)
                    if chunk:
                        data += chunk
                        continue
                    status, detail = _reap(pid, data)
                elif now - start > timeout:
                    os.kill(pid, signal.SIGKILL)
                    proc.join() if proc else os.waitpid(pid, 0)
                    status, detail = "crash", f"timeout after {timeout:.0f} s"
                else:
                    continue
                if proc:
                    proc.close()
                else:
                    os.close(fd)
                del running[fd]
                results[case.name] = {"status": status, "detail": detail[:300]}
                if progress:
                    print(f"{len(results):5d}/{len(cases)} {status:8s} {case.name} "
                          f"({now - start:.1f} s) {detail[:120]}", flush=True)
    return results


def _reap_served(proc: Any, path: str) -> tuple[str, str]:
    """The result of a finished forkserver child (its file), or how it ended without one."""
    proc.join()
    if os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.loads(f.read())
    if proc.exitcode is not None and proc.exitcode < 0:
        return "crash", f"killed by signal {signal.Signals(-proc.exitcode).name}"
    return "crash", f"child exited with status {proc.exitcode} without a result"


def _reap(pid: int, data: bytearray) -> tuple[str, str]:
    _, code = os.waitpid(pid, 0)
    if data:
        return pickle.loads(bytes(data))
    if os.WIFSIGNALED(code):
        return "crash", f"killed by signal {signal.Signals(os.WTERMSIG(code)).name}"
    return "crash", f"child exited with status {os.WEXITSTATUS(code)} without a result"


def ci_subset(cases: list[Case]) -> list[Case]:
    """Deterministic stratified subset: per op, its first test of each recorded status.

    Every op is run at least once, and every (op, status) class once, so a regression in any
    op or a change of any kind of outcome shows.
    """
    by_name = {c.name: c for c in cases}
    expected = load_expected()
    seen: set[tuple[str, str]] = set()
    chosen = []
    for case in cases:
        key = (op_of(case, by_name), expected.get(case.name, {}).get("status", "?"))
        if key not in seen:
            seen.add(key)
            chosen.append(case)
    return chosen


def load_expected() -> dict[str, dict[str, str]]:
    if not STATUS_FILE.exists():
        return {}
    return json.loads(STATUS_FILE.read_text())["tests"]


def _short(detail: str) -> str:
    """A refusal/crash reason without paths and numbers that vary between runs."""
    first = detail.strip().splitlines()[0] if detail.strip() else ""
    if "unsupported operators" in first and "\n" in detail:
        first = detail.strip().splitlines()[1].strip()
    first = re.sub(r"/\S+", "<path>", first)
    first = re.sub(r"<onnx\.ModelProto>:?\s*", "", first)
    return first[:160]


def summarise(results: dict[str, dict[str, str]], cases: list[Case]) -> dict[str, Any]:
    """Counts over the counted tests and over all, plus the pass rate."""
    counted = Counter(r["status"] for n, r in results.items() if not r.get("excluded"))
    every = Counter(r["status"] for r in results.values())
    total = sum(counted.values())
    return {"tests": len(results), "counted": total, "counted_status": dict(counted),
            "all_status": dict(every),
            "pass_rate": round(counted.get("pass", 0) / total, 4) if total else 0.0}


def annotate(results: dict[str, dict[str, str]], cases: list[Case]) -> None:
    """Add each test's op and exclusion reason to its result (in place)."""
    by_name = {c.name: c for c in cases}
    for name, r in results.items():
        case = by_name[name]
        r["op"] = op_of(case, by_name)
        why = exclusion(case)
        if why:
            r["excluded"] = why


def write_status(results: dict[str, dict[str, str]], cases: list[Case]) -> None:
    """The expected-status file: name → status, op, exclusion and (non-pass) reason."""
    import onnx

    tests = {}
    for name in sorted(results):
        r = results[name]
        entry = {"status": r["status"], "op": r["op"]}
        if r.get("excluded"):
            entry["excluded"] = r["excluded"]
        if r["status"] != "pass":
            entry["reason"] = _short(r["detail"])
        tests[name] = entry
    doc = {"onnx": onnx.__version__, "summary": summarise(results, cases), "tests": tests}
    STATUS_FILE.parent.mkdir(parents=True, exist_ok=True)
    STATUS_FILE.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")


def write_coverage(results: dict[str, dict[str, str]], cases: list[Case]) -> None:
    """docs/onnx_coverage.md: per op, pass count and the reasons of the rest."""
    import onnx

    by_op: dict[str, list[tuple[str, dict[str, str]]]] = defaultdict(list)
    for name, r in results.items():
        by_op[r["op"]].append((name, r))
    s = summarise(results, cases)
    c = s["counted_status"]
    lines = [
        "# ONNX operator coverage (cpu target)",
        "",
        f"Generated by `python tools/onnx_conformance.py --update` from the onnx {onnx.__version__} "
        "backend node tests; do not edit by hand. Counted tests exclude non-default domains, "
        "non-tensor or string/complex/fp8/fp4/int4/int2 I/O and random outputs.",
        "",
        f"Counted: {s['counted']} of {s['tests']} tests; pass {c.get('pass', 0)} "
        f"({100 * s['pass_rate']:.1f}%), wrong {c.get('wrong', 0)}, crash {c.get('crash', 0)}, "
        f"refused {c.get('refused', 0)}.",
        "",
        "| op | pass / counted | excluded | not passing (reason, first test) |",
        "|---|---|---|---|",
    ]
    for op in sorted(by_op):
        rows = by_op[op]
        counted = [(n, r) for n, r in rows if not r.get("excluded")]
        passed = sum(r["status"] == "pass" for _, r in counted)
        excluded = sorted({r["excluded"] for _, r in rows if r.get("excluded")})
        reasons: dict[str, str] = {}
        for n, r in sorted(counted):
            if r["status"] != "pass":
                reasons.setdefault(f"{r['status']}: {_short(r['detail'])}", n)
        why = "<br>".join(f"{k.replace('|', '/')} (`{n}`)" for k, n in list(reasons.items())[:3])
        lines.append(f"| {op} | {passed} / {len(counted)} | {', '.join(excluded) or ''} | {why} |")
    COVERAGE_FILE.parent.mkdir(parents=True, exist_ok=True)
    COVERAGE_FILE.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the tests whose name contains this")
    parser.add_argument("--names", help="run only the tests named in this file (one per line)")
    parser.add_argument("--subset", choices=["ci", "full"], default="full")
    parser.add_argument("-j", "--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--deadline", type=float,
                        help="start no new test after this many seconds (the rest: 'not run')")
    parser.add_argument("--update", action="store_true",
                        help="rewrite tests/data/onnx_node_status.json and docs/onnx_coverage.md")
    parser.add_argument("--report", help="write the raw results (JSON) here")
    parser.add_argument("-q", "--quiet", action="store_true")
    parser.add_argument("--target", default="cpu",
                        help="cpu (the recorded statuses) or a CUDA target (sm90, sm80) on a GPU")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile and export only (nvcc for CUDA targets; runs on a CPU machine)")
    parser.add_argument("--float-only", action="store_true",
                        help="only tests whose inputs and outputs are all floating point (the "
                             "issue's GPU set)")
    args = parser.parse_args(argv)
    cases = load_cases()
    if args.subset == "ci":
        cases = ci_subset(cases)
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    if args.names:
        wanted = set(Path(args.names).read_text().split())
        cases = [c for c in cases if c.name in wanted]
    if args.float_only:
        cases = [c for c in cases if is_float_case(c)]
    if args.update and (args.target != "cpu" or args.compile_only):
        parser.error("--update records the cpu target's statuses")
    start = time.monotonic()
    results = run_cases(cases, args.jobs, args.timeout, progress=not args.quiet,
                        target=args.target, compile_only=args.compile_only,
                        deadline=args.deadline)
    annotate(results, cases)
    if args.update and any(r["status"] == "not run" for r in results.values()):
        parser.error("--update needs every test run (no --deadline cut)")
    print(json.dumps(summarise(results, cases)), f"in {time.monotonic() - start:.0f} s")
    if args.report:
        Path(args.report).write_text(json.dumps(results, indent=1) + "\n")
    if args.update:
        if args.only or args.names or args.subset != "full":
            parser.error("--update needs the full set (no --only, --subset full)")
        write_status(results, cases)
        write_coverage(results, cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
