"""Every shell command README.md shows runs as shown (issue 16).

The commands come from README.md's fenced code blocks: lines starting with ``tvmfuse ``,
``python `` or ``pip install`` (a ``$ `` prompt stripped, ``&&`` chains split); lines under a
``$`` command in the same block are its output, which must match (a trailing ``...`` in the
README elides the rest of a line). Usage lines (``[--opt ...]``) are checked against ``--help``.

``test_readme_commands_in_a_fresh_venv`` (slow, a few minutes): a clean venv (no system site
packages), the README's own install line from this checkout, then each command in README order in
a scratch directory (``models`` linked in, as "from the repository root"). Commands that need a
GPU (``run`` of a CUDA library, the Python API block) run in ``test_readme_gpu_commands`` /
``test_readme_python_api`` on the GPU machine, in the current environment.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
STARTS = ("tvmfuse ", "python ", "pip install")


@dataclass
class Command:
    text: str
    output: list[str] = field(default_factory=list)  # expected output lines (prompted examples)

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def is_install(self) -> bool:
        return self.text.startswith("pip install")

    @property
    def is_test_suite(self) -> bool:
        return self.text.startswith("python -m pytest")


def _blocks(markdown: str) -> list[tuple[str, list[str]]]:
    """Fenced code blocks as (info string, lines)."""
    return [(m.group(1).strip(), m.group(2).splitlines())
            for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", markdown, re.M | re.S)]


def _is_usage(line: str) -> bool:
    """A synopsis line (``tvmfuse compile MODEL -o LIB.so [--target ...]``), not a command."""
    return line.startswith("tvmfuse ") and re.search(r" \[--?\w|\b(MODEL|LIB\.so|IN\.npz|DIR)\b",
                                                     line) is not None


def readme_commands(markdown: str | None = None) -> tuple[list[Command], list[str]]:
    """(commands in README order, usage lines) from the shell code blocks."""
    commands: list[Command] = []
    usage: list[str] = []
    for info, lines in _blocks(markdown if markdown is not None else README.read_text()):
        if info not in ("", "bash", "sh", "console", "shell"):
            continue
        prompted = any(line.startswith("$ ") for line in lines)
        current: Command | None = None
        for line in lines:
            text = line[2:] if line.startswith("$ ") else line
            if prompted and not line.startswith("$ "):
                if current is not None:
                    current.output.append(line)
                continue
            text = re.sub(r"\s+#.*$", "", text).strip()  # a trailing comment
            if line.startswith("  ") and text.startswith("[") and usage:  # a wrapped usage line
                usage[-1] += " " + text
                continue
            if not text.startswith(STARTS):
                current = None
                continue
            if _is_usage(text):
                usage.append(text)
                current = None
                continue
            for part in text.split(" && "):
                current = Command(part.strip())
                commands.append(current)
    return commands, usage


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def needs_gpu(cmd: Command, built: dict[str, str]) -> str | None:
    """Why ``cmd`` needs a GPU (None: it runs on a CPU machine). ``built``: library → target of the
    ``tvmfuse compile`` commands before it."""
    argv = cmd.argv
    if argv[:2] == ["tvmfuse", "run"]:
        device = argv[argv.index("--device") + 1] if "--device" in argv else None
        if device == "cuda" or (device is None and built.get(argv[2], "sm90") != "cpu"):
            return f"runs {argv[2]} (target {built.get(argv[2], 'sm90')}) on the GPU"
    return None


def _record_build(cmd: Command, built: dict[str, str]) -> None:
    argv = cmd.argv
    if argv[:2] == ["tvmfuse", "compile"] and "-o" in argv:
        built[argv[argv.index("-o") + 1]] = argv[argv.index("--target") + 1] if "--target" in argv \
            else "sm90"


def _write_bad_onnx(path: Path) -> None:
    """The README's ``bad.onnx``: two nodes with operators no converter handles."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu0"),
             helper.make_node("FooBar", ["a"], ["b"], name="custom1", domain="acme"),
             helper.make_node("NoSuchOnnxOp", ["b"], ["y"], name="weird2")]
    model = helper.make_model(helper.make_graph(nodes, "bad", [x], [y]), opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("acme", 1)])
    onnx.save(model, path)


def _scratch(tmp_path: Path) -> Path:
    """The directory the commands run in: ``models`` importable, the README's input files made."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "models").symlink_to(REPO / "models")
    _write_bad_onnx(work / "bad.onnx")
    return work


def _check_output(cmd: Command, stdout: str, stderr: str) -> None:
    """Each README output line is a prefix of the real line at the same place (``...`` elides)."""
    if not cmd.output:
        return
    real = (stdout + stderr).splitlines()
    first = next((i for i, line in enumerate(real) if line.startswith(cmd.output[0][:12])), None)
    assert first is not None, f"{cmd.text}: output has no line like {cmd.output[0]!r}:\n{stdout}{stderr}"
    for k, want in enumerate(cmd.output):
        got = real[first + k] if first + k < len(real) else ""
        want = want.rstrip().removesuffix("...").rstrip()
        assert " ".join(got.split()).startswith(" ".join(want.split())), \
            f"{cmd.text}: README shows {want!r}, the command printed {got!r}"


def _run(cmd: Command, cwd: Path, env: dict[str, str], timeout: int) -> None:
    run = subprocess.run(cmd.text, shell=True, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout)
    expect_error = any(line.startswith("error:") for line in cmd.output)
    if expect_error:
        assert run.returncode == 1 and "Traceback" not in run.stderr, (cmd.text, run.stderr[-3000:])
    else:
        assert run.returncode == 0, f"{cmd.text} exited {run.returncode}:\n{run.stderr[-3000:]}"
    if cmd.text.startswith("tvmfuse "):  # torch's own deprecation warnings are silenced
        assert "FutureWarning" not in run.stderr, run.stderr[-3000:]
    _check_output(cmd, run.stdout, run.stderr)


# ---------------------------------------------------------------------------------------- fast checks

def test_readme_shows_the_commands_this_test_runs():
    commands, usage = readme_commands()
    texts = [c.text for c in commands]
    assert texts[0] == 'pip install -e ".[torch,cuda]"', texts[:3]
    for prefix in ("tvmfuse compile", "tvmfuse run", "tvmfuse tune", "tvmfuse report", "python -c"):
        assert any(t.startswith(prefix) for t in texts), prefix
    assert {u.split()[1] for u in usage} >= {"compile", "tune", "run", "report"}
    assert any(c.output and c.output[0].startswith("error:") for c in commands)  # the bad.onnx example


def test_parser_on_a_sample():
    sample = ("```bash\npip install -e . && tvmfuse compile m:f -o a.so  # note\nls\n```\n"
              "```\ntvmfuse run LIB.so [--device cpu]\n```\n"
              "```\n$ tvmfuse report m:f\nline one ...\n```\n```python\npython -c 'no'\n```\n")
    commands, usage = readme_commands(sample)
    assert [c.text for c in commands] == ["pip install -e .", "tvmfuse compile m:f -o a.so",
                                          "tvmfuse report m:f"]
    assert commands[2].output == ["line one ..."]
    assert usage == ["tvmfuse run LIB.so [--device cpu]"]


def test_usage_lines_match_the_cli():
    """Every option a usage line shows is one the command's ``--help`` lists."""
    from click.testing import CliRunner

    from tvmfuse.cli import main

    _, usage = readme_commands()
    for line in usage:
        sub = line.split()[1]
        helptext = CliRunner().invoke(main, [sub, "--help"]).output
        for opt in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", line):
            assert opt in helptext, f"README usage {line!r}: `tvmfuse {sub}` has no {opt}"
        for choice in re.findall(r"--\w[\w-]* ([a-z0-9]+(?:\|[a-z0-9]+)+)", line):
            for value in choice.split("|"):
                assert value in helptext, f"README usage {line!r}: {value} is not a choice"


# ---------------------------------------------------------------------------------------- fresh venv

@pytest.mark.slow
def test_readme_commands_in_a_fresh_venv(tmp_path):
    """The install line in a clean venv, then every command in README order (GPU ones skipped)."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler: tvmfuse export links with g++")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "TVMFUSE_STRICT")}
    paths = [p for p in env.get("PATH", "").split(os.pathsep) if Path(sys.prefix) not in Path(p).parents]
    env["PATH"] = os.pathsep.join([str(env_dir / "bin"), *paths])
    env["VIRTUAL_ENV"] = str(env_dir)
    work = _scratch(tmp_path)
    commands, _ = readme_commands()
    built: dict[str, str] = {}
    skipped = []
    for cmd in commands:
        if cmd.is_test_suite:
            skipped.append(f"{cmd.text}: the test suite itself (CI runs it)")
            continue
        why = needs_gpu(cmd, built)
        if why and not _cuda_available():
            skipped.append(f"{cmd.text}: {why} (test_readme_gpu_commands on the GPU machine)")
            continue
        _run(cmd, REPO if cmd.is_install else work, env, timeout=900 if cmd.is_install else 300)
        _record_build(cmd, built)
        if cmd.is_install:  # the venv is clean: only what the install line brought
            probe = subprocess.run(["python", "-c", "import tvmfuse, sys; print(tvmfuse.__file__)"],
                                   env=env, capture_output=True, text=True, cwd=tmp_path)
            assert probe.stdout.strip() == str(REPO / "tvmfuse" / "__init__.py"), probe
    print("\n".join(["not run here:"] + skipped))


@pytest.mark.gpu
def test_readme_gpu_commands(tmp_path):
    """On the GPU machine: every command but installs and the test suite, in the current env."""
    work = _scratch(tmp_path)
    bin_dir = tmp_path / "bin"  # `python` and `tvmfuse` of this interpreter, installed or not
    bin_dir.mkdir()
    # a wrapper, not a symlink: a venv's python reached through a symlink elsewhere does not find
    # its pyvenv.cfg and loses the venv's packages (on the device: "No module named 'numpy'")
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "tvmfuse").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m tvmfuse.cli "$@"\n')
    (bin_dir / "tvmfuse").chmod(0o755)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    for cmd in readme_commands()[0]:
        if not (cmd.is_install or cmd.is_test_suite):
            _run(cmd, work, env, timeout=300)


@pytest.mark.gpu
def test_readme_python_api(tmp_path, monkeypatch):
    """The README's Python API block, verbatim, on the GPU."""
    (block,) = [lines for info, lines in _blocks(README.read_text()) if info == "python"]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile("\n".join(block), "README.md (Python API)", "exec"), namespace)  # noqa: S102
    assert tuple(namespace["y"].shape) == (1, 128, 512) and namespace["y"].is_cuda
    assert namespace["y_np"].shape == (1, 128, 512)
