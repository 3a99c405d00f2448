"""Attention: O = softmax(Q·Kᵀ·scale + mask)·V, prefill and decode, fp16 and bf16.

Layout BSNH: q (B, Sq, Hq, D), k/v (B, Skv, Hkv, D). Workloads (cuda):
  prefill, causal and non-causal: B4·S2048·H16·D128, B1·S8192·H32·D128, GQA B1·S4096·32q/8kv·D128,
    GQA B1·S2048·16q/4kv·D128 (the 4-layer LM's)
  decode: B8, one query, KV 8192, 32q/8kv, D128
cpu smoke: B1·S64·H2·D32 causal and a decode B1·KV64.
FLOPs = 4·B·Hq·Sq·Skv·D, halved when causal. Decode also reports TB/s over the K/V bytes
(2·B·Skv·Hkv·D·2), the HBM floor at 4.21 TB/s.

``--mode pipeline`` (default): ``tvmfuse.compile`` of the SDPA module — torch.export decomposes
SDPA into matmuls, masks and softmax, and FuseAttention must find it again for the flash kernel
to be used; the row times the loaded library per call.
``--mode kernel``: the PrimFunc of ``tvmfuse.rules.attention.attention_primfunc`` is built
with ``tvm.compile`` (builds run in parallel processes) and timed directly (s_tir kernels only:
the sm90a TIRx kernel needs tvmfuse's hybrid TIR pipeline); every row's notes say so.
Baselines: sdpa_ms = ``F.scaled_dot_product_attention`` (flash backend on CUDA) on the same BSNH
tensors (transposed views); torch_eager_ms = naive attention (matmul, mask, fp32 softmax,
matmul), which in float32 is also the correctness reference.
``--only WORD[,WORD]``: the rows whose ``<name>_<dtype>`` holds a word, e.g.
``--only causal_B4_S2048_H16_float16,causal_gqa_B1_S4096_32q8kv_float16``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import os
from pathlib import Path
from typing import Any

import common
import torch
import torch.nn.functional as F
from torch import nn

# name → (B, Sq, Skv, Hq, Hkv, D)
PREFILL = {
    "cuda": {"B4_S2048_H16": (4, 2048, 2048, 16, 16, 128), "B1_S8192_H32": (1, 8192, 8192, 32, 32, 128),
             "gqa_B1_S4096_32q8kv": (1, 4096, 4096, 32, 8, 128),
             "gqa_B1_S2048_16q4kv": (1, 2048, 2048, 16, 4, 128)},  # the 4-layer LM's attention
    "cpu": {"B1_S64_H2": (1, 64, 64, 2, 2, 32)},
}
DECODE = {"cuda": {"decode_B8_KV8192_32q8kv": (8, 1, 8192, 32, 8, 128)},
          "cpu": {"decode_B1_KV64": (1, 1, 64, 4, 2, 32)}}


class SDPA(nn.Module):
    """``F.scaled_dot_product_attention`` on BSNH tensors (GQA via ``enable_gqa``)."""

    def __init__(self, causal: bool, gqa: bool) -> None:
        super().__init__()
        self.causal, self.gqa = causal, gqa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=self.causal, enable_gqa=self.gqa)
        return o.transpose(1, 2)


class NaiveAttention(nn.Module):
    """matmul → scale → causal mask (bottom-right) → fp32 softmax → matmul, on BSNH tensors."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        g = q.shape[1] // k.shape[1]
        if g > 1:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        if self.causal:
            sq, skv = s.shape[-2:]
            mask = torch.ones(sq, skv, dtype=torch.bool, device=q.device).triu(skv - sq + 1)
            s = s.masked_fill(mask, float("-inf"))
        return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v).transpose(1, 2)


def _spec_kw(dims: tuple[int, ...], dtype: str, causal: bool) -> dict[str, Any]:
    b, sq, skv, hq, hkv, d = dims
    return dict(batch=b, q_len=sq, kv_len=skv, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dtype,
                scale=d ** -0.5, causal="BottomRight" if causal else "none")


def _build(spec_kw: dict[str, Any], target_name: str, path: str) -> str:
    """Worker process: build ``attention_primfunc`` to a shared library; '' or the error."""
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    try:
        import tvm

        from tvmfuse.kernels.attention.spec import AttentionSpec
        from tvmfuse.rules.attention import attention_primfunc
        from tvmfuse.targets import get_target

        target = get_target(target_name).tvm_target()
        func = attention_primfunc(AttentionSpec(**spec_kw), target)
        tvm.compile(tvm.IRModule({"main": func}), target=target).export_library(path)
        return ""
    except Exception as err:  # reported in the row
        return common.short_error(err)


def _cases(device: str) -> list[tuple[str, tuple[int, ...], str, bool]]:
    cases = []
    for dtype in ("float16", "bfloat16"):
        for name, dims in PREFILL[device].items():
            for causal in (True, False):
                cases.append((f"attn_{'causal' if causal else 'full'}_{name}", dims, dtype, causal))
        for name, dims in DECODE[device].items():
            cases.append((f"attn_{name}", dims, dtype, False))
    return cases


def _kernel_row(name: str, dims: tuple[int, ...], dtype: str, causal: bool, lib_path: str,
                build_error: str, args: argparse.Namespace) -> dict[str, Any]:
    import tvm

    b, sq, skv, hq, hkv, d = dims
    flops = 4.0 * b * hq * sq * skv * d / (2 if causal else 1)
    kv_bytes = 2.0 * b * skv * hkv * d * 2
    notes = ["kernel timed directly (attention_primfunc; the model pipeline's rewrite is not "
             "exercised)"]
    row: dict[str, Any] = {"workload": name, "shape": f"B={b} Sq={sq} Skv={skv} Hq={hq} Hkv={hkv} "
                           f"D={d}" + (" causal" if causal else ""), "dtype": dtype,
                           "target": args.target, "tvmfuse_ms": None, "baselines": {},
                           "rel_err": None}
    dev = args.device
    q, k, v = (x.to(dev) for x in common.random_inputs(
        [(b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, d)], common.DTYPES[dtype]))
    naive = NaiveAttention(causal)
    ref = common.reference_output(naive, (q, k, v))
    if build_error:
        notes.append(f"tvmfuse build failed: {build_error}")
    else:
        lib = tvm.runtime.load_module(lib_path)
        out = torch.empty_like(q)
        targs = [tvm.runtime.from_dlpack(x) for x in (q, k, v, out)]
        lib["main"](*targs)
        common.sync(dev)
        row["rel_err"] = common.rel_err(out, ref)
        tol = common.TOLERANCE[dtype]
        if not row["rel_err"] <= tol:
            notes.insert(0, f"INCORRECT (rel_err > {tol:g})")
        row["tvmfuse_ms"] = common.time_ms(lambda: lib["main"](*targs), args.warmup, args.iters, dev)
    del ref
    sdpa = SDPA(causal, hq != hkv)
    base = common.baselines(naive, (q, k, v), extra={"sdpa_ms": sdpa}, use_compile=False,
                            warmup=args.warmup, iters=args.iters, device=dev)
    base.pop("torch_compile_ms", None)
    errors = base.pop("errors", {})
    row["baselines"] = base
    notes += [f"{k}: {e}" for k, e in errors.items() if not e.startswith("skipped")]
    times = {"tvmfuse": row["tvmfuse_ms"], **{k.removesuffix("_ms"): t for k, t in base.items()}}
    row["tflops"] = {k: (round(flops / (t * 1e9), 1) if t else None) for k, t in times.items()}
    if sq == 1:
        row["tbps"] = {k: (round(kv_bytes / (t * 1e9), 3) if t else None) for k, t in times.items()}
        row["floor_ms"] = round(kv_bytes / common.H200_HBM_BYTES_PER_S * 1e3, 4)
    ok = row["tvmfuse_ms"] and not notes[0].startswith("INCORRECT")
    row["speedup"] = {k: (round(t / row["tvmfuse_ms"], 3) if ok and t else None)
                      for k, t in times.items() if k != "tvmfuse"}
    row["notes"] = "; ".join(notes)
    return row


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (workload, dtype, causal); ``--only`` keeps the rows whose name and dtype
    contain one of its comma-separated words (``--only causal_B4,full_B4`` with ``_float16``...)."""
    cases = _cases(args.device)
    only = [w for w in getattr(args, "only", "").split(",") if w]
    if only:
        cases = [c for c in cases if any(w in f"{c[0]}_{c[2]}" for w in only)]
    if getattr(args, "mode", "pipeline") == "pipeline":
        rows = []
        for name, dims, dtype, causal in cases:
            b, sq, skv, hq, hkv, d = dims
            wl = common.Workload(
                name=name, module=SDPA(causal, hq != hkv),
                inputs=common.random_inputs([(b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, d)],
                                            common.DTYPES[dtype]),
                shape=f"B={b} Sq={sq} Skv={skv} Hq={hq} Hkv={hkv} D={d}"
                      + (" causal" if causal else ""),
                dtype=dtype, flops=4.0 * b * hq * sq * skv * d / (2 if causal else 1),
                eager=NaiveAttention(causal), extra={"sdpa_ms": SDPA(causal, hq != hkv)},
                notes=["through tvmfuse.compile (model pipeline)"])
            rows.append(common.bench(wl, args))
        return rows
    target = "cpu" if args.device == "cpu" else args.target
    paths = [str(Path(args.workdir) / f"attn_{i}.so") for i in range(len(cases))]
    # spawn, not fork: this process has initialised CUDA, a forked child cannot use it
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(min(len(cases), os.cpu_count() or 2), mp_context=ctx) as pool:
        errors = list(pool.map(_build, [_spec_kw(dims, dt, c) for _, dims, dt, c in cases],
                               [target] * len(cases), paths))
    rows = []
    for (name, dims, dtype, causal), path, err in zip(cases, paths, errors, strict=True):
        rows.append(_kernel_row(name, dims, dtype, causal, path, err, args))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    import sys

    extra = {"--mode": "pipeline", "--only": ""}  # this script's own flags (common.main's parser)
    for flag in extra:
        if flag in sys.argv:
            i = sys.argv.index(flag)
            extra[flag] = sys.argv[i + 1]
            del sys.argv[i:i + 2]

    def run_mode(args: argparse.Namespace) -> list[dict[str, Any]]:
        args.mode, args.only = extra["--mode"], extra["--only"]
        return run(args)

    raise SystemExit(common.main(run_mode, __doc__))
