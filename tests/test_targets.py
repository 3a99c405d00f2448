"""The build targets' TVM Targets."""

from __future__ import annotations

import time

import pytest
import torch

from tvmfuse.targets import get_target


def test_cpu_target_is_portable_llvm_at_o2():
    """The host's generic ISA (no -mcpu / -mattr: the library runs on any CPU of the
    architecture), LLVM at -O2 (targets.CPU_TARGET says why not TVM's -O3)."""
    target = get_target("cpu").tvm_target()
    assert target.kind.name == "llvm"
    assert int(target.attrs["opt-level"]) == 2
    assert not target.attrs.get("mattr") and not target.attrs.get("mcpu")


@pytest.mark.parametrize("name", ["cpu", "sm80", "sm90"])
def test_cuda_targets_keep_a_plain_llvm_host(name):
    target = get_target(name).tvm_target()
    host = target.host if target.host is not None else target
    assert host.kind.name == "llvm"


def test_fp16_kernel_loads_without_minutes_of_codegen():
    """An fp16 Linear + tanh-GELU (64 → 96) for the cpu target: at -O3 LLVM took 130 s to compile
    it at load (soft-float halves unrolled); the whole build-load-run stays far below that."""
    import tvmfuse

    torch.manual_seed(0)
    fc = torch.nn.Linear(64, 96).half()

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.gelu(fc(x), approximate="tanh")

    x = torch.randn(24, 64).half()
    start = time.monotonic()
    out = tvmfuse.compile(M(), (x,), target="cpu").load()(x)
    assert time.monotonic() - start < 60
    ref = torch.nn.functional.gelu(
        torch.nn.functional.linear(x.float(), fc.weight.float(), fc.bias.float()), approximate="tanh")
    assert torch.allclose(torch.as_tensor(out).float(), ref, atol=2e-2, rtol=2e-2)
