"""Device properties by target (tvmfuse/device_props.py): the table, the overrides, and the tile
and cost decisions that follow them (an sm80 build picks its tiles for an A100's 108 SMs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.test_schedule_gemm_sm80 import te_linear
from tvmfuse import device_props, pipeline
from tvmfuse.device_props import DEVICES, DeviceProperties, device_properties
from tvmfuse.errors import TvmfuseError
from tvmfuse.frontend import import_model
from tvmfuse.options import Options, use_options
from tvmfuse.rules import GemmSM80
from tvmfuse.rules.gemm_simt_stats import LARGE_CONFIG, MEDIUM_CONFIG, pick_config
from tvmfuse.rules.gemm_sm80 import TILE_ATTR
from tvmfuse.rules.gemm_sm90 import select_config
from tvmfuse.targets import get_target

SM80, SM90 = get_target("sm80"), get_target("sm90")
# 4096 x 896: 16 x 7 = 112 tiles of 256 x 128 — at least one a SM on an A100 (108), not on an H200
M, N, K = 4096, 896, 512


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    """The table, not the GPU this runs on (a GPU's SM count would win over the table)."""
    monkeypatch.setattr(device_props, "detected_gpu", lambda: None)
    monkeypatch.delenv("TVMFUSE_DEVICE", raising=False)


def test_table_by_target():
    assert device_properties(SM80).sms == 108 and device_properties(SM80).name == "A100"
    assert device_properties(SM90).sms == 132 and device_properties(SM90).bandwidth == 4.21e12
    assert device_properties(SM80.tvm_target()) == DEVICES["a100"]
    with SM90.tvm_target():  # None: the current TVM target
        assert device_properties() == DEVICES["h200"]


def test_overrides(monkeypatch):
    monkeypatch.setenv("TVMFUSE_DEVICE", "h100-pcie")
    assert device_properties(SM90).sms == 114
    mine = DeviceProperties("test part", 7, 100 * 1024, 100 * 1024, 1e12, 1e14)
    with use_options(Options(device=mine)):  # the argument wins over the environment
        assert device_properties(SM90) is mine
    with use_options(Options(device="a100")):
        assert device_properties(SM90).sms == 108
    with use_options(Options(device="b200")), pytest.raises(TvmfuseError, match="unknown device"):
        device_properties(SM90)


def test_detected_gpu_replaces_sms(monkeypatch):
    """A GPU the target's code runs on gives its SM count; one it does not run on is ignored."""
    monkeypatch.setattr(device_props, "detected_gpu", lambda: ("NVIDIA H100 PCIe", "9.0", 114))
    got = device_properties(SM90)
    assert (got.sms, got.bandwidth, got.name) == (114, DEVICES["h100-pcie"].bandwidth,
                                                  "NVIDIA H100 PCIe")
    monkeypatch.setattr(device_props, "detected_gpu", lambda: ("NVIDIA A100-SXM4-80GB", "8.0", 108))
    assert device_properties(SM90) == DEVICES["h200"]  # sm_90a code does not run on an A100
    assert device_properties(SM80).sms == 108


def _tile(device: str | None) -> str:
    with use_options(Options(device=device)):
        sch = GemmSM80().apply(te_linear(M, N, K), SM80.tvm_target(), False)
    return str(sch.mod["main"].attrs[TILE_ATTR])


def test_sm80_rule_tiles_follow_the_sms():
    """112 blocks of the large tile: enough for an A100's 108 SMs (which also cuts the large
    tile to 3 stages: 4 need 221 KB of shared memory, an A100 block has 163 KB), too few for an
    H200's 132 (the 128 x 128 tile, 2 blocks a SM)."""
    assert _tile(None) == "256x128x64w64x64s3r8b1"  # target sm80: the A100 entry
    assert _tile("h200") == "128x128x64w64x64s3r8b1"
    assert DEVICES["a100"].smem_per_block < 4 * (256 + 128) * 72 * 2


def test_sm80_build_picks_tiles_for_an_a100():
    """``pipeline.lower`` for target sm80 (a plain fp16 Linear as a user writes it) gives the GEMM
    the tile chosen for 108 SMs; with the H200's properties the other one."""
    torch.manual_seed(0)
    model = nn.Linear(K, N).half()
    imported = import_model(model, (torch.randn(M, K).half(),), {})

    def tiles(options: Options | None) -> set[str]:
        lowered = pipeline.lower(imported.mod, SM80, options=options)
        return {str(f.attrs[TILE_ATTR]) for _, f in lowered.functions_items()
                if f.attrs is not None and TILE_ATTR in f.attrs}

    assert tiles(None) == {"256x128x64w64x64s3r8b1"}
    assert tiles(Options(device="h200")) == {"128x128x64w64x64s3r8b1"}


def test_simt_and_sm90_tiles_follow_the_sms():
    # 11 x 10 = 110 tiles of 128 x 128: one a SM on an A100, not on an H200
    assert pick_config(1408, 1280, DEVICES["a100"].sms) == LARGE_CONFIG
    assert pick_config(1408, 1280, DEVICES["h200"].sms) == MEDIUM_CONFIG
    assert select_config(4096, 4096, 132).num_sms == 132
    with SM90.tvm_target(), use_options(Options(device="h100-pcie")):
        assert select_config(4096, 4096).num_sms == 114  # the persistent grid: one CTA a SM
