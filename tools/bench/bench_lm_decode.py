"""Greedy decode of a Llama-style LM: tvmfuse ``compile_lm`` vs torch with a static KV cache.

The model is transformers' ``LlamaForCausalLM`` at random init in fp16 (``--size lm4``: vocab 8192,
hidden 2048, 4 layers, 16 query / 4 KV heads, FFN 5632 — the LLM issue's 4-layer LM, 197 M
weights = 394 MB read per token; ``7b``: Llama-2-7B's shapes, built on the GPU (``7b4``: with 4
layers); ``tiny``: a 2-layer
hidden-256 model for a quick check). ``--batch`` prompts of ``--ctx`` random tokens, then ``--new``
greedy tokens each (``compile_lm(max_batch=batch)``; decode ms/token is per step of the batch).

* tvmfuse: ``compile_lm(model, target, max_seq_len=ctx + new, prefill_lengths=[ctx])`` → export →
  load → ``generate``; decode ms/token from the library's timings (the replay loop of the captured
  CUDA graph: decode + on-device argmax per step), and the summed kernel time of one step
  (torch.profiler over graph replays).
* torch eager: ``model.generate`` (dynamic cache), ms/token = (t(new) − t(1)) / (new − 1).
* torch.compile: ``mode="reduce-overhead"`` (CUDA graphs) of one decode step over transformers'
  ``StaticCache`` in a hand-written greedy loop (:func:`static_cache_steps`; transformers'
  ``generate`` with ``cache_implementation="static"`` failed under it on torch 2.11), the loop's
  time / (new − 1) (``--no-compile`` skips it).

Correctness (the LLM issue's rule): tvmfuse's tokens against eager torch's greedy tokens; where
they differ, the step counts as a tie when torch's top-2 logits (teacher-forced on tvmfuse's
sequence) differ by < 1e-3 relative and the chosen token's logit is within 2e-2 relative of the
top. Weight-read floor = weight bytes / 4.21 TB/s.

``--ratio-batch N`` (the LLM issue's "batch 8 ≤ 1.4× its batch-1 step time"): a second process
compiles the model at ``max_batch=N`` (same options, same ``max_seq_len``) while this one compiles
the main library, so one device call measures every 7B line; the two libraries' decode is then
timed in interleaved rounds and batch N's tokens get the tie-aware check too. Each compile time is
taken with the other running beside it (an upper bound on the compile alone).

    python3 tools/bench/bench_lm_decode.py --size lm4 --ctx 2048 --new 32 --out results.json
    python3 tools/bench/bench_lm_decode.py --size 7b --ctx 1024 --new 32 --batch 8 --no-compile
    python3 tools/bench/bench_lm_decode.py --size lm4 --no-compile --ab gemv_preload_weights=False
    python3 tools/bench/bench_lm_decode.py --size 7b --ctx 1024 --no-compile --prefill-len 2048 \
        --compile-prefill --ratio-batch 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import torch

SIZES = {
    "lm4": {"vocab_size": 8192, "hidden_size": 2048, "num_hidden_layers": 4,
            "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 5632},
    "tiny": {"vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 688},
    # Llama-2-7B's shapes (the LLM issue's 7B-class model): 13.5 GB of fp16 weights
    "7b": {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008},
}
# the 7B shapes with 4 layers: per-layer prefill/decode diagnostics at a tenth of the compile time
SIZES["7b4"] = {**SIZES["7b"], "num_hidden_layers": 4}
_BUILD_ON_GPU = {"7b", "7b4"}  # random init of 6.7 B weights on the CPU takes minutes


def build(size: str, max_pos: int):
    """transformers' LlamaForCausalLM of ``size`` at random init (seed 0), fp16, eval mode, on the
    CPU (what compile_lm exports); the 7B shape is initialised on the GPU (fp32, then halved: 27 GB
    transiently) and moved."""
    import transformers

    cfg = transformers.LlamaConfig(**SIZES[size], max_position_embeddings=max_pos)
    torch.manual_seed(0)
    with torch.device("cuda" if size in _BUILD_ON_GPU else "cpu"):
        model = transformers.LlamaForCausalLM(cfg).eval().half()
    model = model.cpu()
    if size in _BUILD_ON_GPU:
        torch.cuda.empty_cache()  # a --ratio-batch compile builds its own copy on the GPU next
    return model


def compile_library(model, options, *, target: str, max_seq: int, batch: int, lengths: list[int],
                    out_dir: str | Path) -> Path:
    """``compile_lm`` under ``options`` → the exported library's path (weights beside it)."""
    import tvmfuse
    from tvmfuse.options import use_options

    with use_options(options):
        lib = tvmfuse.compile_lm(model, target=target, max_seq_len=max_seq, max_batch=batch,
                                 prefill_lengths=lengths)
    return lib.export(Path(out_dir) / "lm.so")


def start_batch_compile(args: argparse.Namespace, options, batch: int, max_seq: int
                        ) -> tuple[subprocess.Popen, Path]:
    """This script in a second process (``--compile-only``): the same model and options at
    ``max_batch=batch``, compiled while the caller compiles its own library; its log and
    ``compile.json`` land in the returned folder."""
    out = Path(tempfile.mkdtemp(prefix=f"lm-decode-b{batch}-"))
    cmd = [sys.executable, __file__, "--size", args.size, "--ctx", str(args.ctx), "--new", str(args.new),
           "--batch", str(batch), "--target", args.target, "--max-seq", str(max_seq),
           "--options-json", json.dumps(dataclasses.asdict(options)), "--compile-only", str(out)]
    with open(out / "compile.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), out


def finish_batch_compile(proc: subprocess.Popen, out: Path) -> dict[str, Any]:
    """Wait for :func:`start_batch_compile`'s process: ``compile.json`` (library path, compile_s)
    or, where it failed, the tail of its log under ``error``."""
    rc = proc.wait()
    done = out / "compile.json"
    if rc == 0 and done.exists():
        return json.loads(done.read_text())
    tail = (out / "compile.log").read_text()[-1500:]
    return {"error": f"the batch compile exited with {rc}: {tail}"}


def compiled_prefill_ms(model, ids: torch.Tensor) -> float:
    """torch.compile (default mode) of the whole forward over the prompt: best of 5 after warm-up
    (the anchor of the issue's "prefill at ≤ 1.0× torch.compile")."""
    fwd = torch.compile(model.forward)
    with torch.no_grad():
        for _ in range(2):
            fwd(ids)
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fwd(ids)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def torch_ms_per_token(model, ids: torch.Tensor, new: int, **gen: Any) -> tuple[float, torch.Tensor]:
    """(ms per decode token, tokens) of ``model.generate``: (t(new) − t(1)) / (new − 1)."""
    def run(n: int) -> tuple[float, torch.Tensor]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **gen)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    run(new)  # warm-up (and compilation)
    t1 = min(run(1)[0] for _ in range(2))
    tn, out = min((run(new) for _ in range(2)), key=lambda r: r[0])
    return (tn - t1) * 1e3 / (new - 1), out


def static_cache_steps(model, ids: torch.Tensor, new: int,
                       compile_mode: str | None) -> tuple[float, torch.Tensor]:
    """(ms per decode token, tokens): a hand-written greedy loop over transformers' StaticCache —
    prefill eagerly, then ``new − 1`` single-token steps through ``torch.compile(mode=...)`` of
    the forward (None: eager). The step's logits are cloned and each step is marked
    (``cudagraph_mark_step_begin``): CUDA-graph outputs are overwritten by the next replay."""
    from transformers import StaticCache

    ctx = ids.shape[1]
    dev = ids.device
    cache = StaticCache(config=model.config, max_cache_len=ctx + new + 8)

    def forward(tok, pos):
        return model(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1]

    step = torch.compile(forward, mode=compile_mode, fullgraph=True) if compile_mode else forward

    def run() -> tuple[float, list[torch.Tensor]]:
        cache.reset()
        with torch.no_grad():
            tok = forward(ids, torch.arange(ctx, device=dev)).argmax(-1, keepdim=True)
            toks = [tok]
            sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            for i in range(new - 1):
                if compile_mode:
                    torch.compiler.cudagraph_mark_step_begin()
                logits = step(tok, torch.tensor([ctx + i], device=dev)).clone()
                tok = logits.argmax(-1, keepdim=True)
                toks.append(tok)
            sync()
        return time.perf_counter() - t0, toks

    run()  # warm-up (compilation, graph capture)
    best, toks = min((run() for _ in range(2)), key=lambda r: r[0])
    return best * 1e3 / (new - 1), torch.cat([ids, *toks], dim=1)


def tie_check(model, seq: torch.Tensor, ctx: int, ref: torch.Tensor) -> dict[str, Any]:
    """The issue's token rule, per sequence of the batch: tvmfuse's tokens must equal ``ref``
    (torch's free-running greedy tokens); where they part, the step must be a tie (torch's top-2
    logits within 1e-3 relative) and tvmfuse's token within 2e-2 of torch's top logit. After the
    parting step the sequences differ, so later steps are judged on tvmfuse's prefix: torch
    teacher-forced on tvmfuse's sequence, each step where its argmax is not tvmfuse's token under
    the same two conditions (``differing_steps``, with their ``row``). Before the parting step
    tvmfuse's tokens are torch's greedy ones; where torch's one-pass teacher-forced forward picks
    another token there (its own two paths disagree), the step is listed in
    ``teacher_forced_only`` and not judged. ``parting_step_per_row``: each sequence's first step
    off torch's tokens (None: none); ``equal``: the whole sequences are torch's."""
    bad: list[dict[str, Any]] = []
    unjudged: list[dict[str, Any]] = []
    parted_at = []
    for row in range(seq.shape[0]):
        with torch.no_grad():  # the logits that chose each new token
            logits = model(seq[row:row + 1]).logits[0, ctx - 1:-1].float()
        got, want = seq[row, ctx:], logits.argmax(-1)
        parted = (got != ref[row, ctx:]).nonzero().flatten().tolist()
        first = parted[0] if parted else None
        parted_at.append(first)
        steps = set((got != want).nonzero().flatten().tolist() + parted[:1])
        for i in sorted(steps):
            top2 = logits[i].topk(2).values
            gap = float((top2[0] - top2[1]).abs() / top2[0].abs())
            close = float((logits[i, got[i]] - top2[0]).abs() / top2[0].abs()) < 2e-2
            entry = {"row": row, "step": i, "tie": gap < 1e-3, "within_2e-2": close,
                     "top2_gap_rel": gap}
            (bad if first is not None and i >= first else unjudged).append(entry)
    first_parting = [p for p in parted_at if p is not None]
    return {"differing_steps": bad, "teacher_forced_only": unjudged,
            "first_step_parting_from_eager": min(first_parting) if first_parting else None,
            "parting_step_per_row": parted_at,
            "ok": all(b["tie"] and b["within_2e-2"] for b in bad),
            "equal": bool(torch.equal(seq, ref))}


def fp32_verdict(model, seq: torch.Tensor, ctx: int, bad: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each differing step: the fp32 model's (teacher-forced on tvmfuse's sequence) top-2 gap
    and whether its argmax is tvmfuse's token (``tvmfuse_is_fp32_argmax``) or torch fp16's. Casts
    ``model`` to fp32 in place (run last)."""
    model.float()
    out = []
    for b in bad:
        row, i = b["row"], b["step"]
        with torch.no_grad():
            logits = model(seq[row:row + 1, :ctx + i]).logits[0, -1].double()
        top2 = logits.topk(2)
        gap = (top2.values[0] - top2.values[1]).abs() / top2.values[0].abs()
        out.append({"row": row, "step": i, "fp32_top2_gap_rel": float(gap),
                    "tvmfuse_is_fp32_argmax": bool(int(top2.indices[0]) == int(seq[row, ctx + i]))})
    return out


def kernel_us_per_step(lm, steps: int = 8) -> tuple[float, dict[str, float], dict[str, Any]]:
    """Summed GPU kernel time of one decode step (over whole steps, :func:`step_increments`'
    ``kernel_us``) and its largest kernels (µs per step: torch.profiler over ``generate`` with
    ``steps + 1`` new tokens minus the same with 1, prefill only, divided by ``steps``); and the
    step's critical path (:func:`step_increments`)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(1, lm.metadata["vocab"], (lm.max_batch, lm.prefill_lengths[0]))

    def kernel_us(new: int) -> tuple[Counter, list]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            lm.generate(ids, max_new_tokens=new)
        kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        return Counter({e.key: e.device_time_total for e in prof.key_averages()
                        if e.device_type.name == "CUDA"}), kernels

    per, kernels = kernel_us(steps + 1)
    per.subtract(kernel_us(1)[0])
    top = {k[:80]: round(v / steps, 2) for k, v in per.most_common(16) if v > 0}
    path = step_increments(kernels, steps)
    # the difference of two runs carries the prefill's run-to-run noise (±100 µs a step at the
    # 7B shapes' batch 8); the kernels of whole decode steps do not
    total = path.get("kernel_us", sum(per.values()) / steps)
    return total, top, path


def step_increments(kernels: list[tuple[float, float, str]], steps: int) -> dict[str, Any]:
    """Where a decode step's wall time goes when kernels overlap (programmatic launch): over the
    last ≤ ``steps`` whole steps (each ending with the greedy ``advance`` kernel), each kernel's
    *increment* = its end − the previous kernel's end (µs; the first kernel's includes the gap
    from the last step), averaged per position in the step. The increments sum to the step's
    span; a kernel whose blocks waited early for their predecessor shows only what it added.
    ``kernel_us``: the step's summed kernel durations (with programmatic launch they overlap, so
    it exceeds the span)."""
    from collections import Counter

    ends = [i for i, (_, _, name) in enumerate(kernels) if "advance" in name][-steps - 1:]
    if len(ends) < 2:
        return {"error": f"{len(ends)} advance kernels: no whole step"}
    windows = [kernels[a:b + 1] for a, b in zip(ends[:-1], ends[1:])]
    counts = Counter(len(w) for w in windows)
    common = counts.most_common(1)[0][0]  # steps with other counts (a stray event) are left out
    kept = [w for w in windows if len(w) == common]
    names = [name for _, _, name in kept[0][1:]]
    rows = [[w[i][1] - w[i - 1][1] for i in range(1, len(w))] for w in kept]
    mean = [statistics.fmean(col) for col in zip(*rows)]
    busy = statistics.fmean(sum(end - start for start, end, _ in w[1:]) for w in kept)
    order = sorted(range(len(mean)), key=lambda i: -mean[i])
    return {"span_us": round(sum(mean), 2), "kernel_us": round(busy, 2), "kernels": len(mean),
            "steps": len(kept),
            "events_per_step": dict(counts),
            "by_position": [[i, names[i][:60], round(mean[i], 2)] for i in order[:24]]}


def prefill_kernels_us(lm, ids: torch.Tensor) -> tuple[float, dict[str, float]]:
    """Summed GPU kernel time of one prefill of ``ids`` and its largest kernels (µs)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        lm.generate(ids, max_new_tokens=1)
    times = sorted(((e.device_time_total, e.key) for e in prof.key_averages()
                    if e.device_type.name == "CUDA"), reverse=True)
    return sum(t for t, _ in times), {k[:80]: round(t, 1) for t, k in times[:12]}


def interleaved_decode(runs: dict[str, tuple[Any, torch.Tensor]], new: int, rounds: int
                       ) -> tuple[dict[str, list[float]], dict[str, list[torch.Tensor]]]:
    """Decode ms/token of loaded libraries, each on its own prompts (``name → (lm, ids)``), timed
    in turn for ``rounds`` rounds after a warm-up: a drift of the GPU over the run reaches all
    alike. Returns each library's times and tokens per round."""
    for lm, ids in runs.values():
        lm.generate(ids, max_new_tokens=4)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, list[torch.Tensor]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (lm, ids) in runs.items():
            tokens[name].append(lm.generate(ids, max_new_tokens=new))
            times[name].append(lm.timings["decode_ms_per_token"])
    return times, tokens


def ab_rounds(base, others: dict[str, Any], ids: torch.Tensor, new: int, rounds: int,
              base_tokens: torch.Tensor) -> dict[str, Any]:
    """:func:`interleaved_decode` of ``base`` and each other library on the same prompts. The
    others' tokens must equal ``base``'s (the same model; only kernels differ)."""
    times, tokens = interleaved_decode({name: (lm, ids) for name, lm in {"base": base, **others}.items()},
                                       new, rounds)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"rounds_ms_per_token": times, "median_ms_per_token": medians,
            "over_base": {k: medians[k] / medians["base"] for k in others},
            "tokens_equal": {k: all(torch.equal(t, base_tokens) for t in tokens[k]) for k in others}}


def batch_ratio(lm, ids: torch.Tensor, compiled: dict[str, Any], batch: int, new: int,
                rounds: int) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor | None]:
    """Batch ``batch``'s decode step time over batch 1's (``lm`` on ``ids``): the library
    :func:`finish_batch_compile` reported, loaded and timed with ``lm`` by
    :func:`interleaved_decode` on ``batch`` prompts (seed 1; row 0 is ``ids``' prompt). Returns
    the row's ``ratio`` entry, batch ``batch``'s prompts and tokens (None where its compile
    failed)."""
    import tvmfuse

    if "error" in compiled:
        return compiled, None, None
    torch.manual_seed(1)
    ids_n = torch.randint(1, lm.metadata["vocab"], (batch, ids.shape[1]))
    lm_n = tvmfuse.load(compiled["library"], device="cuda")
    times, tokens = interleaved_decode({"1": (lm, ids), str(batch): (lm_n, ids_n)}, new, rounds)
    medians = {k: statistics.median(v) for k, v in times.items()}
    got = tokens[str(batch)][-1]
    return {"batch": batch, "compile_s": compiled["compile_s"], "rounds_ms_per_token": times,
            "median_ms_per_token": medians, "ratio": medians[str(batch)] / medians["1"],
            "timings": dict(lm_n.timings),
            "tokens_same_every_round": all(torch.equal(t, got) for t in tokens[str(batch)])}, ids_n, got


def parse_variant(text: str) -> dict[str, Any]:
    """``FIELD[=VALUE][,FIELD[=VALUE]…]`` → Options fields (VALUE: True (default), False, an int,
    else the string)."""
    bools = {"": True, "True": True, "False": False}
    fields: dict[str, Any] = {}
    for part in text.split(","):
        field, _, value = part.partition("=")
        fields[field] = bools[value] if value in bools else int(value) if value.lstrip(
            "-").isdigit() else value
    return fields


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), default="lm4")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (max_batch)")
    p.add_argument("--compile-prefill", action="store_true",
                   help="also time torch.compile (default mode) of the prompt's forward")
    p.add_argument("--prefill-len", type=int, default=None,
                   help="also compile and time a prefill of this many tokens (best of 3; the "
                        "--compile-prefill anchor then runs at this length)")
    p.add_argument("--target", default="sm90")
    p.add_argument("--no-gemv", action="store_true",
                   help="Options(small_m_gemv=False): decode GEMMs on the GEMM kernels")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--gemv-simt-max-m", type=int, default=4,
                   help="Options.gemv_simt_max_m: M up to which the GEMV runs on CUDA cores")
    p.add_argument("--programmatic-launch", choices=["decode", "all", "off"], default="decode",
                   help="Options.programmatic_launch (sm_90: PDL between kernels)")
    p.add_argument("--programmatic-launch-max-batch", type=int, default=None,
                   help="Options.programmatic_launch_max_batch (above it 'decode' is off)")
    p.add_argument("--gemv-l2-prefetch", type=int, default=0,
                   help="Options.gemv_l2_prefetch_bytes (with programmatic launch)")
    p.add_argument("--decode-fused-combine", action="store_true",
                   help="Options.decode_fused_combine: the split-KV combine in the partial kernel")
    p.add_argument("--gemv-prefetch-after-attention", action="store_true",
                   help="Options.gemv_prefetch_after_attention: the O projection's GEMV prefetches "
                        "its weight into L2 during the attention")
    p.add_argument("--fold-append", action="store_true",
                   help="Options.decode_fold_append: the decode append inside the attention kernel")
    p.add_argument("--decode-kv-prefetch", type=int, default=None,
                   help="Options.decode_kv_prefetch_bytes (0: the decode attention prefetches "
                        "no cache rows before its PDL wait; default: the option's default)")
    p.add_argument("--ab", metavar="FIELD[=VALUE][,FIELD[=VALUE]]", action="append", default=[],
                   help="also compile with Options.FIELD=VALUE (default True; True / False / an "
                        "int; several fields comma-separated; repeat --ab for more libraries) and "
                        "time every library's decode in interleaved rounds in this process "
                        "(medians under 'ab')")
    p.add_argument("--ab-rounds", type=int, default=7)
    p.add_argument("--options", metavar="FIELD[=VALUE][,FIELD[=VALUE]]", default=None,
                   help="Options fields of the main library (as --ab spells them): its tokens get "
                        "the tie-aware check against eager")
    p.add_argument("--ratio-batch", type=int, default=None, metavar="N",
                   help="also compile at max_batch=N in a second process (beside the main compile) "
                        "and time both libraries' decode in interleaved rounds: the batch-N / "
                        "batch-1 step-time ratio (needs --batch 1)")
    p.add_argument("--max-seq", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--options-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--compile-only", metavar="DIR", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    if args.ratio_batch is not None and (args.batch != 1 or args.ratio_batch < 2):
        p.error("--ratio-batch N needs --batch 1 and N >= 2")

    import tvmfuse
    from tvmfuse.options import Options

    if args.compile_only:  # start_batch_compile's process: the library and its compile time
        max_seq = args.max_seq
        model = build(args.size, max_seq + 8)
        t0 = time.perf_counter()
        path = compile_library(model, Options(**json.loads(args.options_json)), target=args.target,
                               max_seq=max_seq, batch=args.batch, lengths=[args.ctx],
                               out_dir=args.compile_only)
        done = {"library": str(path), "compile_s": round(time.perf_counter() - t0, 1)}
        (Path(args.compile_only) / "compile.json").write_text(json.dumps(done))
        return

    prefill_len = args.prefill_len or args.ctx
    max_seq = max(args.ctx + args.new, prefill_len) + 1
    model = build(args.size, max_seq + 8)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    row: dict[str, Any] = {"workload": "lm_decode", "size": args.size, "ctx": args.ctx, "new": args.new,
                           "batch": args.batch, "target": args.target, "gemv": not args.no_gemv,
                           "weight_mb": weight_bytes / 1e6,
                           "floor_ms": weight_bytes / common.H200_HBM_BYTES_PER_S * 1e3}
    t0 = time.perf_counter()
    row["gemv_simt_max_m"] = args.gemv_simt_max_m
    row["programmatic_launch"] = args.programmatic_launch
    row["gemv_l2_prefetch"] = args.gemv_l2_prefetch
    row["decode_fused_combine"] = args.decode_fused_combine
    row["decode_fold_append"] = args.fold_append
    row["gemv_prefetch_after_attention"] = args.gemv_prefetch_after_attention
    extra = {} if args.decode_kv_prefetch is None else {"decode_kv_prefetch_bytes": args.decode_kv_prefetch}
    if args.programmatic_launch_max_batch is not None:
        extra["programmatic_launch_max_batch"] = args.programmatic_launch_max_batch
    row["decode_kv_prefetch_bytes"] = Options(**extra).decode_kv_prefetch_bytes
    row["programmatic_launch_max_batch"] = Options(**extra).programmatic_launch_max_batch
    opts = Options(small_m_gemv=not args.no_gemv, gemv_simt_max_m=args.gemv_simt_max_m,
                   programmatic_launch=args.programmatic_launch,
                   gemv_l2_prefetch_bytes=args.gemv_l2_prefetch,
                   decode_fused_combine=args.decode_fused_combine,
                   decode_fold_append=args.fold_append,
                   gemv_prefetch_after_attention=args.gemv_prefetch_after_attention, **extra)
    if args.options:
        opts = dataclasses.replace(opts, **parse_variant(args.options))
        row["options"] = parse_variant(args.options)

    def compiled(options: Options):
        path = compile_library(model, options, target=args.target, max_seq=max_seq, batch=args.batch,
                               lengths=sorted({args.ctx, prefill_len}),
                               out_dir=tempfile.mkdtemp(prefix="lm-decode-"))
        return tvmfuse.load(path, device="cuda")

    batch_compile = None if args.ratio_batch is None else start_batch_compile(
        args, opts, args.ratio_batch, max_seq)
    lm = compiled(opts)
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    print("compile_s", row["compile_s"], flush=True)
    torch.manual_seed(1)
    ids = torch.randint(1, SIZES[args.size]["vocab_size"], (args.batch, args.ctx))
    lm.generate(ids, max_new_tokens=4)  # warm-up
    got = lm.generate(ids, max_new_tokens=args.new)
    row["tvmfuse"] = dict(lm.timings)
    print("tvmfuse", lm.timings, flush=True)
    if args.ab:
        others = {text: compiled(dataclasses.replace(opts, **parse_variant(text))) for text in args.ab}
        row["ab"] = ab_rounds(lm, others, ids, args.new, args.ab_rounds, got)
        print("ab", row["ab"], flush=True)
    if prefill_len != args.ctx:
        long_ids = torch.randint(1, SIZES[args.size]["vocab_size"], (args.batch, prefill_len))
        times = []
        for _ in range(4):  # the first warms up
            lm.generate(long_ids, max_new_tokens=1)
            times.append(lm.timings["prefill_ms"])
        row["tvmfuse"]["prefill_len"], row["tvmfuse"]["prefill_ms_at_len"] = prefill_len, min(times[1:])
        print("tvmfuse prefill", prefill_len, min(times[1:]), flush=True)
    try:
        prompt_ids = long_ids if prefill_len != args.ctx else ids
        total, top = prefill_kernels_us(lm, prompt_ids)
        row["tvmfuse"]["prefill_kernel_us"], row["tvmfuse"]["prefill_top_kernels_us"] = total, top
        total, top, path = kernel_us_per_step(lm)
        row["tvmfuse"]["kernel_us_per_step"], row["tvmfuse"]["top_kernels_us"] = total, top
        row["tvmfuse"]["step_increments"] = path
        print("step increments", path, flush=True)
    except Exception as err:  # noqa: BLE001 - the profile is extra information
        row["tvmfuse"]["kernel_us_per_step"] = f"profile failed: {err}"[:200]
    if batch_compile is not None:
        row["ratio"], ids_n, got_n = batch_ratio(lm, ids, finish_batch_compile(*batch_compile),
                                                 args.ratio_batch, args.new, args.ab_rounds)
        row["ratio"]["max_seq"] = max_seq
        print("ratio", row["ratio"], flush=True)

    gpu = model.cuda()
    ids_gpu = ids.cuda()
    eager_ms, ref = torch_ms_per_token(gpu, ids_gpu, args.new)
    row["eager_ms_per_token"] = eager_ms
    row["tokens"] = tie_check(gpu, got.cuda(), args.ctx, ref)
    print("eager", eager_ms, row["tokens"], flush=True)
    if batch_compile is not None and got_n is not None:  # batch N's tokens: the same rule
        row["ratio"]["eager_ms_per_token"], ref_n = torch_ms_per_token(gpu, ids_n.cuda(), args.new)
        row["ratio"]["tokens"] = tie_check(gpu, got_n.cuda(), args.ctx, ref_n)
        print("ratio tokens", row["ratio"]["tokens"], flush=True)
    if args.compile_prefill:
        try:
            prompt = ids_gpu if prefill_len == args.ctx else long_ids.cuda()
            row["compile_prefill_len"] = prefill_len
            row["compile_prefill_ms"] = compiled_prefill_ms(gpu, prompt)
        except Exception as err:  # noqa: BLE001 - report, keep the row
            row["compile_prefill_ms"] = f"failed: {type(err).__name__}: {err}"[:300]
        print("compile prefill", row["compile_prefill_ms"], flush=True)
    if not args.no_compile:
        try:
            row["compile_ms_per_token"], seq = static_cache_steps(gpu, ids_gpu, args.new,
                                                                  "reduce-overhead")
            row["compile_tokens_equal_eager"] = bool(torch.equal(seq, ref))
        except Exception as err:  # noqa: BLE001 - report, keep the row
            row["compile_ms_per_token"] = f"failed: {type(err).__name__}: {err}"[:300]
        print("compile", row["compile_ms_per_token"], flush=True)
    checked = [(row["tokens"], got)]
    if batch_compile is not None and got_n is not None:
        checked.append((row["ratio"]["tokens"], got_n))
    for tokens, seq in checked:  # fp16 torch and tvmfuse differ: what fp32 says (last: casts)
        steps = tokens["differing_steps"] + tokens["teacher_forced_only"]
        if steps:
            try:
                tokens["fp32_reference"] = fp32_verdict(gpu, seq.cuda(), args.ctx, steps)
            except Exception as err:  # noqa: BLE001 - report, keep the row
                tokens["fp32_reference"] = f"failed: {type(err).__name__}: {err}"[:300]
            print("fp32 reference", tokens["fp32_reference"], flush=True)
    print(row, flush=True)
    if args.out:
        common.write_results(args.out, [row], common.command_line(), append=True)


if __name__ == "__main__":
    main()
