"""Config spaces of the sm_90a kernels (``tvmfuse.kernel_configs``) and their tuning records.

CPU: every candidate is a kernel the generator accepts; a config record written by the tuner is
applied by ``compile`` (the kernel's tile changes) only when it beat the default by the margin,
and an unusable record falls back to the default. GPU: every candidate computes the right numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tvmfuse.frontend import import_model
from tvmfuse.targets import get_target

SM90 = get_target("sm90")


class _Linear(nn.Module):
    """GELU(x·Wᵀ + b) with constant W, b."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class _Attention(nn.Module):
    """Causal SDPA on BSNH tensors."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return o.transpose(1, 2)


def _gemm_model(m: int = 256, n: int = 512, k: int = 512):
    torch.manual_seed(0)
    return _Linear(n, k).half(), (torch.randn(m, k, dtype=torch.float16),)


def _attention_model(b: int = 1, s: int = 256, h: int = 2, d: int = 64):
    torch.manual_seed(0)
    return _Attention(), tuple(torch.randn(b, s, h, d, dtype=torch.float16) for _ in range(3))


def _tasks(model, inputs):
    from tvmfuse.tune import extract_tasks

    return {t.pattern: t for t in extract_tasks(import_model(model, inputs, {}).mod, SM90)
            if t.space is not None}


@pytest.fixture(scope="module")
def tasks() -> dict:
    return {**_tasks(*_gemm_model()), **_tasks(*_attention_model())}


def test_spaces_found_and_candidates_valid(tasks):
    from tvmfuse.kernel_configs import attention_flops
    from tvmfuse.kernels.gemm.sm90 import GemmConfig
    from tvmfuse.rules.gemm_sm90 import select_config

    gemm, attn = tasks["gemm_epilogue"], tasks["attention"]
    assert gemm.space.kind == "gemm_sm90" and attn.space.kind == "attention_sm90"
    assert GemmConfig(**gemm.space.default) == select_config(256, 512)
    for space in (gemm.space, attn.space):
        assert space.candidates[0] == space.default
        assert len({json.dumps(c, sort_keys=True) for c in space.candidates}) == len(space.candidates)
    assert len(gemm.space.candidates) >= 10 and len(attn.space.candidates) >= 4
    # causal S=256: 256·257/2 visible pairs, 4 FLOPs per pair per head-dim element
    assert attn.flops == attention_flops(str(attn.mod["main"].attrs["tvmfuse.attention_spec"]))
    assert attn.flops == 4 * 1 * 2 * 64 * (256 * 257 // 2)
    for space in (gemm.space, attn.space):  # first, a middle and the last candidate generate
        for cfg in (space.candidates[1], space.candidates[len(space.candidates) // 2],
                    space.candidates[-1]):
            func = space.build(cfg)["main"]
            assert func.attrs["tvmfuse.tirx"] and func.attrs["global_symbol"] == "main"


def test_attention_key_is_the_spec_not_the_kernel(tasks):
    from tvmfuse.tuning_db import task_key_of

    attn = tasks["attention"]
    other = attn.space.build(attn.space.candidates[1])["main"]
    assert task_key_of(other) == task_key_of(attn.mod["main"]) == attn.key
    # a different shape is a different task
    assert _tasks(*_attention_model(s=128))["attention"].key != attn.key


def test_attention_flops_bottom_right():
    from tvmfuse.kernel_configs import attention_flops

    spec = {"batch": 1, "q_len": 2, "kv_len": 5, "q_heads": 1, "head_dim": 1, "causal": "BottomRight"}
    assert attention_flops(json.dumps(spec)) == 4 * (4 + 5)  # query 0 sees keys 0..3, query 1 all
    assert attention_flops(json.dumps({**spec, "causal": "TopLeft"})) == 4 * (1 + 2)
    assert attention_flops(json.dumps({**spec, "causal": "none"})) == 4 * 10
    # a window of 2 keys: query 0 sees keys 2..3, query 1 keys 3..4 (BottomRight)
    assert attention_flops(json.dumps({**spec, "window": 2})) == 4 * (2 + 2)


class _FakeBuilder:
    """Stands in for MetaSchedule's builder: no GPU here, so nothing is built."""

    def build(self, inputs):
        from tvm.s_tir import meta_schedule as ms

        return [ms.builder.BuilderResult(None, "not built on the CPU machine") for _ in inputs]


def _write_config_db(tmp_path: Path, task, times: list[float | None]) -> Path:
    """Run the tuner's config path with given candidate timings (ms) and write the database."""
    from tvmfuse import tune as tune_mod
    from tvmfuse.tuning_db import TuningDatabase

    db = TuningDatabase.open(tmp_path / "db", create=True)
    db.target = "sm90"
    real = tune_mod._measure_many
    # the tuner times the default first and again last: give the repeat the default's time
    tune_mod._measure_many = lambda mods, *a: [
        (v, None if v else "run: failed") for v in (times + times[:1])[:len(mods)]]
    try:
        space = task.space
        task.space.candidates = space.candidates[:len(times)]
        tune_mod._run_task(task, SM90, None, len(times), _FakeBuilder(), None, 1,
                           "random", tune_mod._Progress(0, False), 1, db)
    finally:
        tune_mod._measure_many = real
    return tmp_path / "db"


def _tiles(model, inputs, db: Path | None) -> dict[str, tuple[str, str]]:
    """Kernel name → (tile attribute, tuning label) after the pipeline's schedule stage."""
    from tvmfuse.pipeline import lower

    seen: dict = {}

    def keep(name, mod):
        if name == "schedule":
            seen["mod"] = mod

    lower(import_model(model, inputs, {}).mod, SM90, None, on_stage=keep, tuning_db=db)
    out = {}
    for gv, f in seen["mod"].functions_items():
        if hasattr(f, "attrs") and f.attrs is not None and "tvmfuse.tile" in f.attrs:
            out[gv.name_hint] = (str(f.attrs["tvmfuse.tile"]), str(f.attrs.get("tvmfuse.tuning", "")))
    return out


def _tile_label(which: str, cfg: dict) -> str:
    """The ``tvmfuse.tile`` attribute the kernel of ``cfg`` carries."""
    if which == "gemm":
        return f"{cfg['bm']}x{cfg['bn']}x64 stages={cfg['stages']}"
    return f"{64 * cfg['consumers']}x{cfg['block_n']} stages={cfg['stages']}"


@pytest.mark.parametrize("which", ["gemm", "attention"])
def test_config_record_applied_only_when_clearly_faster(tmp_path, which):
    model, inputs = _gemm_model() if which == "gemm" else _attention_model()
    task = _tasks(model, inputs)["gemm_epilogue" if which == "gemm" else "attention"]
    cands = task.space.candidates
    n = len(cands)
    # the last candidate whose tile differs from the default's is 10 % faster than the default:
    # recorded and used by compile, so the compiled kernel's tile changes
    default_tile = _tile_label(which, cands[0])
    fast = max(i for i, c in enumerate(cands) if _tile_label(which, c) != default_tile)
    times = [1.0] + [1.05] * (n - 1)
    times[fast] = 0.9
    db = _write_config_db(tmp_path / "fast", task, times)
    summary = next(iter(json.loads((db / "tvmfuse_tasks.json").read_text())["tasks"].values()))
    assert summary["space"].startswith("configs:") and summary["use_tuned"]
    assert summary["config"] == cands[fast] and len(summary["candidates"]) == n
    assert summary["candidates"][0]["ms_again"] == 1.0  # the default, timed again at the end
    default_tiles = _tiles(model, inputs, None)
    tuned_tiles = _tiles(model, inputs, db)
    (name,) = [k for k, (_, label) in tuned_tiles.items() if label == "tuned"]
    assert default_tiles[name][0] == default_tile  # no database: the default config
    assert tuned_tiles[name][0] == _tile_label(which, cands[fast]) != default_tile
    # within the noise margin (0.5 % faster): the default config stays
    db2 = _write_config_db(tmp_path / "noise", task, [1.0] + [None] * (n - 2) + [0.995])
    summary = next(iter(json.loads((db2 / "tvmfuse_tasks.json").read_text())["tasks"].values()))
    assert not summary["use_tuned"] and summary["tuned_ms"] == 0.995
    labels = {k: label for k, (_, label) in _tiles(model, inputs, db2).items()}
    assert labels[name].startswith("default: the fastest other config") and "noise" in labels[name]


def test_unusable_config_record_falls_back(tmp_path):
    model, inputs = _gemm_model()
    task = _tasks(model, inputs)["gemm_epilogue"]
    db = _write_config_db(tmp_path, task, [1.0, 0.5])
    meta = json.loads((db / "tvmfuse_tasks.json").read_text())
    for s in meta["tasks"].values():
        s["config"] = {**s["config"], "bn": 512}  # a tile the kernel generator refuses
    (db / "tvmfuse_tasks.json").write_text(json.dumps(meta))
    labels = {k: label for k, (_, label) in _tiles(model, inputs, db).items()}
    (label,) = labels.values()
    assert label.startswith("default: tuned config unusable") and "512" in label


# ---- GPU: every candidate computes what the default does ------------------------------------------

def _outputs_of_every_candidate(model, inputs, pattern: str):
    """Each candidate run on the same random arguments (signature of the task function; the last
    parameter is the output). The default config is the kernel the other GPU tests check against
    torch; every other config must agree with it."""
    import numpy as np
    import tvm

    from tvmfuse.rules.gemm_sm90 import HYBRID_PIPELINE
    from tvmfuse.tvm_setup import register_tvm_patches

    register_tvm_patches()  # registers HYBRID_PIPELINE

    task = _tasks(model, inputs)[pattern]
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    from tvm.s_tir import meta_schedule as ms

    # (kind, dtype, shape) per parameter, handles (TIRx match_buffer) included; fp16 models
    info = [a.as_json() for a in ms.arg_info.ArgInfo.from_prim_func(task.mod["main"])]
    args = [tvm.runtime.tensor((rng.standard_normal(shape) * 0.5).astype(dtype), dev)
            for _, dtype, shape in info[:-1]]
    outs = []
    for cfg in task.space.candidates:
        lib = tvm.tirx.build(task.space.build(cfg), target=SM90.tvm_target(), pipeline=HYBRID_PIPELINE)
        out = tvm.runtime.empty(info[-1][2], info[-1][1], dev)
        lib["main"](*args, out)
        outs.append((cfg, out.numpy().astype("float64")))
    ref = outs[0][1]
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    return [(cfg, float(np.abs(o - ref).max() / np.abs(ref).max())) for cfg, o in outs[1:]]


@pytest.mark.gpu
def test_gpu_every_gemm_config_agrees_with_default():
    errs = _outputs_of_every_candidate(*_gemm_model(m=1000, n=768, k=1024), "gemm_epilogue")
    bad = [(c, e) for c, e in errs if not e < 2e-3]
    assert errs and not bad, bad


@pytest.mark.gpu
def test_gpu_every_attention_config_agrees_with_default():
    errs = _outputs_of_every_candidate(*_attention_model(b=2, s=300, h=4, d=128), "attention")
    bad = [(c, e) for c, e in errs if not e < 2e-3]
    assert errs and not bad, bad


def test_gemm_candidates_offer_176_wide_tiles_for_nk_weights_only():
    """The tuner may try 128×176 tiles where B is (N, K) (one TMA box of 176 rows); with (K, N)
    B (64-column chunks) it is not offered. Every candidate passes the kernel's check."""
    from tvmfuse.kernel_configs import gemm_candidates
    from tvmfuse.kernels.gemm.sm90 import GemmConfig, GemmProblem, check

    for layout in ("nt", "nn"):
        cands = gemm_candidates(2048, 4096, layout)
        assert any(c["bn"] == 176 for c in cands) == (layout == "nt")
        problem = GemmProblem(2048, 4096, 2048, "float16", "float16", layout)
        assert [check(problem, GemmConfig(**c)) for c in cands] == [None] * len(cands)
