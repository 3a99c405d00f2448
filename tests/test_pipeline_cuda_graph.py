"""``Options.cuda_graph``: the finalize stage runs TVM's RewriteCUDAGraph with
``relax.backend.use_cuda_graph`` set for that pass only. The kernels between static allocations
move into a capture function that ``main`` runs through ``vm.builtin.cuda_graph.run_or_capture``;
the kernels reading ``main``'s inputs or writing its output stay outside. Off (the default):
``main`` launches every kernel itself. CUDA targets only; the cpu target ignores the option."""

from __future__ import annotations

import torch
from torch import nn

from tvmfuse.frontend import import_model
from tvmfuse.options import Options
from tvmfuse.pipeline import lower
from tvmfuse.targets import get_target


class ThreeLinears(nn.Module):
    """Three GEMM kernels in a row: the middle one reads and writes only intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _main_text(target: str, options: Options | None) -> tuple[str, list[str]]:
    torch.manual_seed(0)
    model = ThreeLinears().half()
    mod = lower(import_model(model, (torch.randn(32, 64, dtype=torch.float16),)).mod,
                get_target(target), options=options)
    return mod["main"].script(), [gv.name_hint for gv in mod.functions]


def test_cuda_graph_captures_the_static_region():
    text, names = _main_text("sm90", Options(cuda_graph=True))
    assert "vm.builtin.cuda_graph.run_or_capture" in text
    assert "vm.builtin.cuda_graph.get_cached_alloc" in text
    assert "main_cuda_graph_capture" in names and "cuda_graph_alloc" in names


def test_default_launches_every_kernel():
    text, names = _main_text("sm90", None)
    assert "cuda_graph" not in text
    assert not any("cuda_graph" in n for n in names)


def test_cpu_target_ignores_the_option():
    text, _ = _main_text("cpu", Options(cuda_graph=True))
    assert "cuda_graph" not in text


def test_compile_lm_turns_it_off():
    """compile_lm's runtime captures the decode step in a torch CUDA graph itself."""
    from tvmfuse.llm.compile_lm import _launch_options

    assert _launch_options(Options(cuda_graph=True), 1).cuda_graph is False
    assert _launch_options(Options(), 1) is None
