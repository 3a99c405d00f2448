"""A tensor-parallel LM library run by one worker process per rank (torch.distributed).

``load(path, ...)`` of a ``compile_lm(..., tensor_parallel=N)`` library returns a
:class:`DistributedLanguageModel`: it starts N processes (``python -m
tvmfuse.runtime.tensor_parallel``, talking over an inherited pipe: the caller's main module is not
re-imported, so no ``if __name__ == "__main__"`` guard is needed), each joins one process group
on localhost (gloo on cpu, nccl on cuda; one GPU per rank), registers the collectives
(:mod:`.collectives`), loads the rank-agnostic ``.so`` with its weights ``<name>.rank<i>.safetensors``
and builds a :class:`~tvmfuse.runtime.lm.LanguageModel`. The parent sends every call
(``generate``, ``prefill``, ``decode``) to all ranks, which run it in lockstep (the gathered logits,
hence the greedy tokens, are the same on every rank), and returns rank 0's answer.

Errors name the rank; a rank that dies or does not answer within ``timeout`` seconds stops all
workers (no hang). ``close()`` (also at exit) stops them.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DeviceError, LibraryError, TvmfuseError

DEFAULT_TIMEOUT_S = float(os.environ.get("TVMFUSE_TP_TIMEOUT", "600"))
WORKER_MODULE = "tvmfuse.runtime.tp_worker"  # run as a program: nothing here imports it
_GRACE_S = 30.0  # how long the other ranks may take to answer once one reported an error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _named(rank: int, err: BaseException) -> BaseException:
    """``err`` with ``rank r:`` in front of its message, same class where it takes one message."""
    try:
        return type(err)(f"rank {rank}: {err}")
    except Exception:  # noqa: BLE001
        return TvmfuseError(f"rank {rank}: {type(err).__name__}: {err}")


class DistributedLanguageModel:
    """A tensor-parallel LM over N worker processes; the API of
    :class:`~tvmfuse.runtime.lm.LanguageModel` (``generate``, ``prefill``, ``decode``)."""

    def __init__(self, path: str | os.PathLike, metadata: dict[str, Any], devices: list[str],
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        import multiprocessing as mp

        self.path, self.metadata, self.devices, self.timeout = Path(path), metadata, devices, timeout
        self.world = int(metadata["tensor_parallel"])
        if len(devices) != self.world:
            raise DeviceError(f"{path} is split over {self.world} ranks (tensor_parallel); got "
                              f"{len(devices)} devices {devices}")
        if len(metadata.get("weight_shards", [])) != self.world:
            raise LibraryError(f"{path}: metadata lists {len(metadata.get('weight_shards', []))} "
                               f"weight shards for {self.world} ranks")
        self.max_seq = int(metadata["max_seq_len"])
        self.max_batch = int(metadata["max_batch"])
        self.prefill_lengths = [int(n) for n in metadata["prefill_lengths"]]
        self.timings: dict[str, float] = {}
        port = _free_port()
        self._conns, self._procs, self._procs_stopped = [], [], []
        env = os.environ | {"PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])])}
        for rank, device in enumerate(devices):
            parent, child = mp.Pipe()
            argv = [sys.executable, "-m", WORKER_MODULE, str(rank), str(self.world),
                    str(self.path.absolute()), device, str(port), str(timeout), str(child.fileno())]
            self._procs.append(subprocess.Popen(argv, pass_fds=[child.fileno()], env=env))
            child.close()
            self._conns.append(parent)
        atexit.register(self.close)
        self._collect()  # each rank's "ready" (or its error)

    def __repr__(self) -> str:
        return (f"DistributedLanguageModel({self.path}, ranks={self.world}, devices={self.devices}, "
                f"max_batch={self.max_batch}, max_seq_len={self.max_seq})")

    def _collect(self) -> list[Any]:
        """Every rank's answer. An error raises once every rank answered (the workers stay up: all
        ranks refuse a bad input alike); a rank that dies, or silence past the timeout (or past
        ``_GRACE_S`` after another rank's error), stops all workers first."""
        from multiprocessing.connection import wait

        pending = dict(enumerate(self._conns))
        answers: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        deadline = time.monotonic() + self.timeout
        while pending:
            for rank, conn in list(pending.items()):
                if conn not in wait([conn], timeout=0):
                    continue
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    continue  # the process is gone: reported below
                del pending[rank]
                (answers if status == "ok" else errors)[rank] = value
            if errors and not pending:
                rank = min(errors)
                raise _named(rank, errors[rank]) from None
            dead = [r for r in pending if self._procs[r].poll() is not None]
            if dead or time.monotonic() > deadline:
                self.close(force=True)
                if errors:
                    rank = min(errors)
                    raise _named(rank, errors[rank]) from None
                if dead:
                    proc = self._procs_stopped[dead[0]]
                    raise TvmfuseError(f"rank {dead[0]} (pid {proc.pid}) died with exit code "
                                       f"{proc.returncode}; the workers were stopped")
                raise TvmfuseError(f"rank(s) {sorted(pending)} did not answer within "
                                   f"{self.timeout:.0f} s; the workers were stopped")
            if errors:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
            wait(list(pending.values()), timeout=0.5)
        return [answers[r] for r in range(self.world)]

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if not self._procs:
            raise TvmfuseError(f"{self!r} is closed")
        for conn in self._conns:
            conn.send((method, args, kwargs))
        answers = self._collect()
        return answers[0]

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        return self._call("prefill", np.asarray(input_ids), attention_mask)

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        return self._call("decode", np.asarray(tokens))

    def generate(self, input_ids: Any, max_new_tokens: int = 16, attention_mask: Any = None) -> Any:
        """Greedy decoding on every rank: (B, T + max_new_tokens) ids; torch in → torch out."""
        is_torch = type(input_ids).__module__.startswith("torch")
        ids = input_ids.cpu().numpy() if is_torch else np.asarray(input_ids)
        if attention_mask is not None and hasattr(attention_mask, "cpu"):
            attention_mask = attention_mask.cpu().numpy()
        out, self.timings = self._call("generate", ids, max_new_tokens, attention_mask)
        if is_torch:
            import torch

            return torch.from_numpy(out).to(input_ids.device)
        return out

    def close(self, force: bool = False) -> None:
        """Stop the workers (``force``: without asking them first)."""
        procs, conns = self._procs, self._conns
        self._procs_stopped, self._procs, self._conns = procs, [], []
        if not force:
            for conn in conns:
                try:
                    conn.send(("close", (), {}))
                except (OSError, BrokenPipeError):
                    pass
        for proc in procs:
            try:
                proc.wait(timeout=0.1 if force else 10)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for conn in conns:
            conn.close()

    def __enter__(self) -> DistributedLanguageModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def rank_devices(kind: str, world: int, devices: list[int] | None) -> list[str]:
    """The device string of each rank: ``cpu`` N times, or ``cuda:<i>`` for ``devices`` (default
    0..N-1)."""
    if kind == "cpu":
        if devices is not None:
            raise DeviceError("devices= lists GPU indices; on device='cpu' each rank is a process")
        return ["cpu"] * world
    devices = list(range(world)) if devices is None else list(devices)
    return [f"cuda:{i}" for i in devices]


__all__ = ["DistributedLanguageModel", "rank_devices"]
