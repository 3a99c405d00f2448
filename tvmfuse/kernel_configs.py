"""Design spaces of tvmfuse's generated sm_90a kernels, for ``tvmfuse tune``.

The TIRx kernels (the wgmma GEMM of :mod:`.schedules.gemm_sm90`, the FA3-style attention of
:mod:`.schedules.flash_attention_sm90`) are not s_tir schedules, so MetaSchedule's trace search
cannot vary them. Their generators take a config instead (tile shape, pipeline depth, raster,
warp-specialisation switches), and that is the space tuned here: every candidate is a complete
kernel, built and timed by MetaSchedule's builder and runner (locally or over RPC), and the
fastest config is recorded. Only configs that the GPU tests check for numerics
(``tests/test_kernel_configs.py``) are in a space.

A space is found for a kernel by :func:`space_for`:

* ``gemm_sm90``: an *unscheduled* fused GEMM PrimFunc that the sm_90a kernel takes (the task key is
  the function's, as for MetaSchedule tasks). Applying a config marks the function with
  :data:`.attrs.CONFIG_ATTR`; the ``gemm_sm90`` stage then generates the kernel with that config.
* ``attention_sm90``: the *scheduled* flash-attention kernel, which carries its
  :class:`.schedules.attention_spec.AttentionSpec` in :data:`.attrs.SPEC_ATTR`; the key is the
  spec's (a new kernel generator keeps the records). Applying a config regenerates the kernel.

This module is the tuning *search* (it sits with ``tvmfuse tune``); reading a record and applying
its config at compile time is :mod:`.tuning_db` (a pipeline stage), which kernels never import.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tvm
from tvm import tirx

from .attrs import SPEC_ATTR
from .kernels.attention.flash_sm90 import (
    Sm90FlashConfig,
    flash_attention_sm90_primfunc,
)
from .kernels.attention.flash_sm90 import (
    check as attention_check,
)
from .kernels.attention.spec import spec_from_json, visible_pairs
from .kernels.gemm.epilogue import NotHandled
from .kernels.gemm.sm90 import GemmConfig, check
from .rules.gemm_sm90 import build_kernel, gemm_problem, select_config
from .tuning_db import attention_key, task_module


@dataclass
class ConfigSpace:
    """The configs of one kernel: ``build(config)`` gives the kernel as a one-function task module."""

    kind: str  # "gemm_sm90" | "attention_sm90"
    key: str
    default: dict[str, Any]
    candidates: list[dict[str, Any]]  # the default first
    build: Callable[[dict[str, Any]], tvm.IRModule]


def _fields(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# ---- GEMM ---------------------------------------------------------------------------------------

def gemm_candidates(m: int, n: int, layout: str = "nt") -> list[dict[str, Any]]:
    """Tile × pipeline depth × raster group; the default (``select_config``) first.

    128×256 at 3/4 stages (48 KiB a stage), 128×128 at 4/6 stages, 64×256 (one consumer
    warpgroup, for short M), 128×176 at 5 stages (B (N, K) only: it fills a last wave 128×256
    leaves part empty), each with raster groups of 4/8/16 row tiles where it differs.
    """
    default = select_config(m, n, layout=layout)
    out = [default]
    tiles = ((128, 256, 4), (128, 256, 3), (128, 128, 6), (128, 128, 4), (64, 256, 4))
    for bm, bn, stages in tiles + (((128, 176, 5),) if layout == "nt" else ()):
        for group_m in (8, 16, 4):
            cfg = GemmConfig(bm=bm, bn=bn, stages=stages, group_m=group_m,
                             num_sms=default.num_sms)
            if cfg not in out:
                out.append(cfg)
    return [_fields(c) for c in out]


def gemm_space(func: tirx.PrimFunc, key: str) -> ConfigSpace | None:
    """The config space of a fused GEMM the sm_90a kernel takes, else None."""
    try:
        problem = gemm_problem(func)
    except NotHandled:
        return None
    if check(problem, select_config(problem.m, problem.n, layout=problem.layout)):
        return None
    cands = [c for c in gemm_candidates(problem.m, problem.n, problem.layout)
             if check(problem, GemmConfig(**c)) is None]

    def build(cfg: dict[str, Any]) -> tvm.IRModule:
        return task_module(build_kernel(func, GemmConfig(**cfg)))

    return ConfigSpace("gemm_sm90", key, cands[0], cands, build)


# ---- attention ----------------------------------------------------------------------------------

def attention_flops(spec_text: str) -> int:
    """``4·B·Hq·D·(visible (query, key) pairs)``: Q·Kᵀ and P·V, causal pairs only (of a spec's
    JSON, or of just the fields this reads)."""
    f = json.loads(spec_text)
    pairs = visible_pairs(f["q_len"], f["kv_len"], f["causal"], f.get("window"))
    return 4 * f["batch"] * f["q_heads"] * f["head_dim"] * pairs


def attention_candidates() -> list[dict[str, Any]]:
    """Default (2 consumers × BN 128, 2 stages, overlap + ping-pong + TMA store) first, then the
    variants the H200 probes measured (tools/bench/NOTES.md, "Flash attention sm90a")."""
    base = Sm90FlashConfig()
    variants = [base, dataclasses.replace(base, stages=3), dataclasses.replace(base, pingpong=False),
                dataclasses.replace(base, overlap=False), dataclasses.replace(base, block_n=64),
                dataclasses.replace(base, block_n=64, stages=4)]
    return [_fields(c) for c in variants]


def attention_space(func: tirx.PrimFunc) -> ConfigSpace | None:
    """The config space of an sm_90a flash-attention kernel, else None."""
    if func.attrs is None or SPEC_ATTR not in func.attrs:
        return None
    text = str(func.attrs[SPEC_ATTR])
    spec = spec_from_json(text)
    cands = [c for c in attention_candidates() if attention_check(spec, Sm90FlashConfig(**c)) is None]
    if not cands:
        return None

    def build(cfg: dict[str, Any]) -> tvm.IRModule:
        return task_module(flash_attention_sm90_primfunc(spec, config=Sm90FlashConfig(**cfg)))

    return ConfigSpace("attention_sm90", attention_key(text), cands[0], cands, build)


# ---- dispatch -----------------------------------------------------------------------------------

def space_for(func: tirx.PrimFunc, key: str, arch: str) -> ConfigSpace | None:
    """The config space of one kernel on ``arch`` (None: no generated kernel takes it)."""
    if arch != "sm_90a":
        return None
    scheduled = bool(func.attrs and func.attrs.get("tirx.is_scheduled", False))
    return attention_space(func) if scheduled else gemm_space(func, key)
