"""The ``tvmfuse`` command line (contract in DESIGN.md).

``tvmfuse run`` needs only the runtime: the compiler side (frontend, compiler, report, tune) is
imported inside the commands that use it, the one place besides ``tvmfuse.compile`` where the
package imports itself lazily.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
import numpy as np

from .errors import TvmfuseError
from .runtime import DistributedLanguageModel, LanguageModel, load, read_metadata
from .runtime.weights import weights_path
from .targets import get_target


class _Group(click.Group):
    """Turns every tvmfuse error into one clear line on stderr and exit code 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except TvmfuseError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(package_name="tvmfuse")
def main() -> None:
    """tvmfuse: compile ONNX / PyTorch models into fused CUDA libraries."""


def _random_inputs(specs, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    arrays = []
    for s in specs:
        if s.dtype.startswith("float") or s.dtype == "bfloat16":
            arrays.append(rng.standard_normal(s.shape).astype(s.dtype))
        elif s.dtype == "bool":
            arrays.append(rng.integers(0, 2, s.shape).astype(bool))
        else:
            arrays.append(rng.integers(0, 8, s.shape).astype(s.dtype))
    return arrays


def check_against_reference(lib, seed: int = 0) -> list[float]:
    """Run a cpu-target Library on random inputs; ‖out − ref‖/‖ref‖ per output vs the framework."""
    if lib.model.reference is None:
        raise TvmfuseError("no reference runtime for this model (install onnxruntime or torch)")
    arrays = _random_inputs(lib.model.inputs, seed)
    outs = lib.load("cpu")(*arrays)
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = lib.model.reference(*arrays)
    errs = []
    for o, r in zip(outs, refs):
        o64, r64 = np.asarray(o, np.float64), np.asarray(r, np.float64)
        errs.append(float(np.linalg.norm(o64 - r64) / max(np.linalg.norm(r64), 1e-30)))
    return errs


_DYNAMIC = click.option(
    "--dynamic", "dynamic", multiple=True, metavar="SYMBOL=LO..HI",
    help="Keep a dimension symbolic over a range: name it in --input (x:1xS) or use the ONNX "
         "dim_param, e.g. --dynamic S=1..4096. One library serves every length.")


@main.command()
@click.argument("model")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Library to write (.so).")
@click.option("--target", type=click.Choice(["sm90", "sm80", "cpu"]), default="sm90",
              show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Convert a float32 model to mixed precision (fp32 accumulation).")
@click.option("--input", "inputs", multiple=True, metavar="NAME:SHAPE[:DTYPE]",
              help="Fix an input's shape, e.g. x:1x2048x4096.")
@_DYNAMIC
@click.option("--tuning-db", type=click.Path(file_okay=False), default=None,
              help="Tuning database written by `tvmfuse tune` (tuned kernels where faster).")
@click.option("--check", is_flag=True,
              help="Also build for cpu and compare with onnxruntime/torch on random inputs.")
@click.option("--weights", type=click.Choice(["auto", "external", "embedded"]), default="auto",
              show_default=True,
              help="external: weights in LIB.safetensors beside LIB.so; auto: external from 256 MB "
                   "(--lm libraries: always external).")
@click.option("--lm", is_flag=True,
              help="MODEL is a cache-less causal LM (ids -> logits): build prefill/decode entry "
                   "points with a derived KV cache, for `tvmfuse generate`.")
@click.option("--max-seq-len", type=click.IntRange(min=2), default=2048, show_default=True,
              help="With --lm: KV cache slots per sequence (prompt + generated tokens).")
@click.option("--max-batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --lm: sequences generated together.")
@click.option("--prefill-lengths", default=None, metavar="N,N,...",
              help="With --lm: prompt lengths compiled (a prompt is padded to the next one).")
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --lm: split the model over N GPUs (Megatron-style; LIB.rank<i>.safetensors "
                   "per rank; run with `generate --gpus N`).")
def compile(model: str, output: str, target: str, dtype: str | None, inputs: tuple[str, ...],
            dynamic: tuple[str, ...], tuning_db: str | None, check: bool, weights: str, lm: bool,
            max_seq_len: int, max_batch: int, prefill_lengths: str | None,
            tensor_parallel: int) -> None:  # noqa: A001
    """Compile MODEL (.onnx, .pt2 or package.module:factory) into LIB.so."""
    from .compiler import compile as tvmfuse_compile

    t0 = time.perf_counter()
    if lm:
        if inputs or dynamic or tuning_db or check or weights == "embedded":
            raise TvmfuseError("--lm takes no --input, --dynamic, --tuning-db, --check or --weights "
                               "embedded (the LM's shapes come from --max-seq-len, --max-batch and "
                               "--prefill-lengths; its weights are always external)")
        _compile_lm(model, output, target, dtype, max_seq_len, max_batch,
                    _int_list(prefill_lengths, "--prefill-lengths") if prefill_lengths else None, t0,
                    tensor_parallel)
        return
    if tensor_parallel != 1:
        raise TvmfuseError("--tensor-parallel needs --lm")
    lib = tvmfuse_compile(model, target=target, dtype=dtype, inputs=list(inputs), tuning_db=tuning_db,
                          dynamic=list(dynamic), weights=weights)
    path = lib.export(output)
    sig = ", ".join(f"{s.name}:{s.dtype}{list(s.shape)}" for s in lib.model.inputs)
    outs = ", ".join(f"{s.name}:{s.dtype}{list(s.shape)}" for s in lib.outputs)
    click.echo(f"wrote {path} (target {target}, {time.perf_counter() - t0:.1f} s)")
    if lib.weights:
        wpath = weights_path(path)
        click.echo(f"  weights: {wpath} ({len(lib.weights)} tensors, {wpath.stat().st_size} bytes)")
    click.echo(f"  inputs:  {sig}\n  outputs: {outs}")
    if lib.model.dynamic:
        ranges = ", ".join(f"{k}={lo}..{hi}" for k, (lo, hi) in lib.model.dynamic.items())
        click.echo(f"  dynamic: {ranges}")
    if check:
        cpu_lib = lib if target == "cpu" else tvmfuse_compile(
            model, target="cpu", dtype=dtype, inputs=list(inputs), dynamic=list(dynamic))
        errs = check_against_reference(cpu_lib)
        tol = 1e-4 if dtype in (None, "float32") else 2e-2
        verdict = "ok" if all(e <= tol for e in errs) else "MISMATCH"
        errs_text = ", ".join(f"{e:.2e}" for e in errs)
        click.echo(f"  check (cpu build vs {lib.model.frontend} reference): "
                   f"rel err {errs_text} (tol {tol:g}): {verdict}")
        if verdict != "ok":
            sys.exit(3)


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as err:
        raise TvmfuseError(f"{option} must be comma-separated integers, got {text!r}") from err


def _compile_lm(model: str, output: str, target: str, dtype: str | None, max_seq_len: int,
                max_batch: int, prefill_lengths: list[int] | None, t0: float,
                tensor_parallel: int = 1) -> None:
    from .llm import compile_lm

    lib = compile_lm(model, target=target, dtype=dtype, max_seq_len=max_seq_len, max_batch=max_batch,
                     prefill_lengths=prefill_lengths, tensor_parallel=tensor_parallel)
    path = lib.export(output)
    meta = lib.metadata
    click.echo(f"wrote {path} (target {target}, LM, {time.perf_counter() - t0:.1f} s)")
    layers = sum(c.get("init") != "zeros" for c in meta["caches"])  # not the decode counters
    click.echo(f"  max_seq_len {meta['max_seq_len']}, max_batch {meta['max_batch']}, vocab "
               f"{meta['vocab']}, {layers} KV-cache layers, prefill lengths {meta['prefill_lengths']}")
    if tensor_parallel > 1:
        click.echo(f"  tensor parallel: {tensor_parallel} ranks, weights "
                   f"{weights_path(path, 0).name} .. {weights_path(path, tensor_parallel - 1).name}")


@main.command()
@click.argument("library", type=click.Path(dir_okay=False))
@click.option("--prompt-ids", required=True, metavar="ID,ID,...",
              help="The prompt's token ids, comma-separated.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Default: cuda for GPU targets, cpu for the cpu target.")
@click.option("--gpus", type=click.IntRange(min=1), default=None,
              help="A tensor-parallel library (`--tensor-parallel N`): one worker per GPU 0..N-1 "
                   "(with --device cpu: N processes). Must equal N.")
def generate(library: str, prompt_ids: str, max_new_tokens: int, device: str | None,
             gpus: int | None) -> None:
    """Greedy generation with a `compile --lm` LIBRARY: prints the new tokens and the times."""
    ids = _int_list(prompt_ids, "--prompt-ids")
    if not ids:
        raise TvmfuseError("--prompt-ids is empty")
    device = _device(library, device)
    world = int(read_metadata(library).get("tensor_parallel", 1))
    if (gpus or 1) != world:
        raise TvmfuseError(f"{library} is split over {world} rank(s) (tensor parallel): run it with "
                           f"--gpus {world}" + (f", not --gpus {gpus}" if gpus else ""))
    model = load(library, device=device, devices=list(range(world)) if device != "cpu" else None)
    if not isinstance(model, (LanguageModel, DistributedLanguageModel)):
        raise TvmfuseError(f"{library} is not a language-model library (build it with "
                           "`tvmfuse compile MODEL --lm`)")
    try:
        out = model.generate(np.asarray([ids], "int64"), max_new_tokens=max_new_tokens)
    finally:
        if isinstance(model, DistributedLanguageModel):
            model.close()
    t = model.timings
    click.echo("tokens: " + ",".join(str(int(x)) for x in out[0, len(ids):]))
    click.echo(f"prefill: {t['prefill_ms']:.2f} ms ({len(ids)} tokens), decode: "
               f"{t['decode_ms_per_token']:.3f} ms/token ({max_new_tokens - 1} steps)")


def _device(library: str, device: str | None) -> str:
    """``device``, or cuda/cpu from the library's target."""
    if device is not None:
        return device
    import tvm  # noqa: F401  (read_metadata needs TVM's symbols)

    if not Path(library).is_file():
        raise TvmfuseError(f"library {library} does not exist")
    return "cpu" if read_metadata(library)["target"] == "cpu" else "cuda"


@main.command()
@click.argument("library", type=click.Path(dir_okay=False))
@click.option("--inputs", "inputs_path", required=True, type=click.Path(dir_okay=False),
              help=".npz with one array per model input name.")
@click.option("--output", "output_path", type=click.Path(dir_okay=False), default=None,
              help=".npz to write, one array per output name.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Default: cuda for GPU targets, cpu for the cpu target.")
def run(library: str, inputs_path: str, output_path: str | None, device: str | None) -> None:
    """Run LIBRARY on the arrays in IN.npz."""
    if not Path(inputs_path).is_file():
        raise TvmfuseError(f"inputs file {inputs_path} does not exist")
    try:
        data = dict(np.load(inputs_path))
    except Exception as err:
        raise TvmfuseError(f"{inputs_path}: not a readable .npz ({err})") from err
    model = load(library, device=_device(library, device))
    if isinstance(model, LanguageModel):
        raise TvmfuseError(f"{library} is a language-model library: run it with `tvmfuse generate`")
    names = [i["name"] for i in model.inputs]
    missing = [n for n in names if n not in data]
    if missing:
        raise TvmfuseError(f"{inputs_path}: missing array(s) for input(s) {missing}; "
                           f"it has {sorted(data)}")
    outs = model(**{n: data[n] for n in names})
    outs = outs if isinstance(outs, tuple) else (outs,)
    result = dict(zip(model.output_names, outs))
    for name, arr in result.items():
        click.echo(f"{name}: {arr.dtype}{list(arr.shape)}")
    if output_path:
        np.savez(output_path, **result)
        click.echo(f"wrote {output_path}")


@main.command()
@click.argument("model")
@click.option("--target", type=click.Choice(["sm90", "sm80", "cpu"]), default="sm90", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
@click.option("--input", "inputs", multiple=True, metavar="NAME:SHAPE[:DTYPE]")
@_DYNAMIC
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (schema in DESIGN.md).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a roofline PNG.")
@click.option("--times", type=click.Path(dir_okay=False, exists=True), default=None,
              help="JSON {kernel name: measured ms} from a benchmark run, placed on the plot.")
@click.option("--tuning-db", type=click.Path(file_okay=False), default=None,
              help="Apply a `tvmfuse tune` database and mark the kernels that use a tuned schedule.")
@click.option("--weights", type=click.Choice(["auto", "external", "embedded"]), default="embedded",
              show_default=True, help="Lower as `compile --weights` does (the kernels are the same).")
def report(model: str, target: str, dtype: str | None, inputs: tuple[str, ...],
           dynamic: tuple[str, ...], as_json: bool,
           plot: str | None, times: str | None, tuning_db: str | None, weights: str) -> None:
    """Kernels after fusion, with FLOPs and HBM bytes against the unfused graph."""
    from .frontend import dynamic_ranges, import_model, input_overrides
    from .report import analyze, format_table, plot_roofline

    imported = import_model(model, None, input_overrides(list(inputs)), dynamic_ranges(list(dynamic)))
    result = analyze(imported.mod, get_target(target), dtype if dtype != "float32" else None,
                     tuning_db=tuning_db, weights=weights)
    times_ms = json.loads(Path(times).read_text()) if times else None
    if times_ms:
        for k in result["kernels"]:
            if k["name"] in times_ms:
                k["measured_ms"] = times_ms[k["name"]]
    if plot:
        plot_roofline(result, plot, times_ms)
    click.echo(json.dumps(result, indent=1) if as_json else format_table(result))
    if plot and not as_json:
        click.echo(f"roofline written to {plot}")


@main.command()
@click.argument("model")
@click.option("--target", type=click.Choice(["sm90", "sm80", "cpu"]), default="sm90", show_default=True)
@click.option("--db", "db", required=True, type=click.Path(file_okay=False),
              help="Database directory (created; a rerun resumes, keeping finished tasks).")
@click.option("--trials", type=int, default=64, show_default=True, help="Measured candidates per task.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
@click.option("--input", "inputs", multiple=True, metavar="NAME:SHAPE[:DTYPE]")
@click.option("--rpc", default=None, metavar="HOST:PORT:KEY",
              help="Measure on the servers of a TVM RPC tracker.")
@click.option("--gpus", type=int, default=None,
              help="Start a local RPC tracker and one server per GPU (CUDA_VISIBLE_DEVICES).")
@click.option("--min-gflop", type=float, default=None,
              help="Tune GEMM/attention kernels of at least this many GFLOP (default 0.1).")
@click.option("--min-mb", type=float, default=None,
              help="Tune norm kernels moving at least this many MB (default 8).")
@click.option("--cost-model", type=click.Choice(["xgb", "random"]), default=None,
              help="Default: xgb when xgboost is installed, else random.")
def tune(model: str, target: str, db: str, trials: int, dtype: str | None, inputs: tuple[str, ...],
         rpc: str | None, gpus: int | None, min_gflop: float | None, min_mb: float | None,
         cost_model: str | None) -> None:
    """Tune MODEL's fused kernels with MetaSchedule into the database DB."""
    from .tune import MIN_GFLOP, MIN_MB
    from .tune import tune as tvmfuse_tune

    report = tvmfuse_tune(model, db=db, target=target, trials=trials, dtype=dtype, inputs=list(inputs),
                          rpc=rpc, gpus=gpus, cost_model=cost_model,
                          min_gflop=MIN_GFLOP if min_gflop is None else min_gflop,
                          min_mb=MIN_MB if min_mb is None else min_mb)
    click.echo(report.table())


if __name__ == "__main__":
    main()
