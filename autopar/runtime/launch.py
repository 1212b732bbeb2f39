"""The real runtime: N processes joined by torch.distributed, each computing its own rank.

The launcher forks N workers (they inherit the model, the plan and the seeded values, and
each keeps only its shards), joins them in one torch.distributed job over TCP on localhost
(gloo on CPU; NCCL when as many GPUs as ranks are present), and gives every collective a
timeout. Each worker writes what it holds to a folder; the launcher reassembles. A worker
that dies (a collective past its timeout ends its rank too) or a port that is taken gives one
sentence and the other workers are stopped: nothing hangs.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from autopar.errors import AutoparError
from autopar.lowering.program import PlanProgram
from autopar.runtime.execute import RankResult, execute
from autopar.runtime.program import Schedule

DEFAULT_TIMEOUT_S = 300.0


class RuntimeFailure(AutoparError):
    """The real runtime could not run the step: a port, a dead rank, a timeout."""


def free_port() -> int:
    """A TCP port on localhost nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def check_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise RuntimeFailure(
                f"Port {port} on 127.0.0.1 is taken; pass another port, or none to pick a free one."
            ) from None


def _bit_sets(schedule: Schedule) -> list[tuple[int, ...]]:
    steps = [step for steps in schedule.forward.values() for step in steps]
    steps += [step for steps in schedule.backward.values() for step in steps]
    steps += [step for step in schedule.sync.values() if step is not None]
    return sorted({step.bits for step in steps})


# what a rank runs once joined: (rank, world, device) -> what it holds (pickled back to the launcher)
Work = Callable[[int, int, Any], Any]


def _step_work(
    program: PlanProgram,
    schedule: Schedule,
    values: Mapping[str, np.ndarray],
    cotangents: Mapping[str, np.ndarray] | None,
    parameters: Sequence[str],
) -> Work:
    def work(rank: int, world: int, device: Any) -> RankResult:
        from autopar.runtime.collectives import DistributedCollectives

        collectives = DistributedCollectives(rank, world, _bit_sets(schedule), device)
        return execute(program, schedule, values, cotangents, collectives, parameters)

    return work


def _worker(rank: int, world: int, port: int, folder: str, timeout_s: float, work: Work) -> None:
    """One rank: join the job, run its work, write what it holds. Never returns into the parent's code."""
    import torch
    import torch.distributed as dist

    code = 0
    try:
        torch.set_num_threads(1)  # N ranks share the machine's cores; one thread each
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
        backend = "nccl" if use_cuda else "gloo"
        device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        result = work(rank, world, device)
        with open(Path(folder) / f"rank{rank}.pkl", "wb") as out:
            pickle.dump(result, out)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # a worker reports every failure, then exits non-zero
        code = 1
        exc = _root(exc)
        last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        where = f" ({Path(last[0].filename).name}:{last[0].lineno})" if last else ""
        (Path(folder) / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}{where}".strip())
    os._exit(code)  # a forked worker must not run the parent's exit handlers


def _root(exc: BaseException) -> BaseException:
    """The failure to report: the error a library raised ours from, where it did (torch's pipeline stages wrap
    what a stage's forward raised in "[Stage 0] failed to run forward", saying nothing of it)."""
    while exc.__cause__ is not None and isinstance(exc, RuntimeError) and "failed to run" in str(exc):
        exc = exc.__cause__
    return exc


def run_processes(
    program: PlanProgram,
    schedule: Schedule,
    values: Mapping[str, np.ndarray],
    cotangents: Mapping[str, np.ndarray] | None,
    parameters: Sequence[str],
    port: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RankResult:
    """Run the step on ``program.num_devices`` processes; the ranks' results merged in rank order."""
    work = _step_work(program, schedule, values, cotangents, parameters)
    return merge(run_workers(program.num_devices, work, port, timeout_s))


def run_workers(world: int, work: Work, port: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``work`` on ``world`` joined processes; what each rank returned, in rank order."""
    import multiprocessing

    if port is None:
        port = free_port()
    else:
        check_port(port)
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="autopar-runtime-") as folder:
        workers = [
            context.Process(target=_worker, args=(rank, world, port, folder, timeout_s, work), daemon=True)
            for rank in range(world)
        ]
        for worker in workers:
            worker.start()
        try:
            _wait(workers, folder)
        finally:
            for worker in workers:
                if worker.is_alive():
                    worker.kill()
                worker.join(5)
        results = []
        for rank in range(world):
            with open(Path(folder) / f"rank{rank}.pkl", "rb") as handle:
                results.append(pickle.load(handle))
    return results


def _wait(workers: list[Any], folder: str) -> None:
    """Until every worker is done, or one dies. A rank waiting on a dead or stuck peer leaves its
    collective after the timeout and exits with the reason, so this never waits forever."""
    while True:
        dead = [(rank, w.exitcode) for rank, w in enumerate(workers) if w.exitcode not in (None, 0)]
        if dead:
            rank, code = min(dead, key=lambda item: _first_error(folder, item[0]))
            error = Path(folder) / f"rank{rank}.error"
            reason = error.read_text() if error.exists() else f"exit code {code}"
            raise RuntimeFailure(f"Rank {rank} of the torch runtime died: {reason}.")
        if all(w.exitcode == 0 for w in workers):
            return
        time.sleep(0.05)


def _first_error(folder: str, rank: int) -> float:
    """When a rank wrote its error: the first to fail is the cause, the others its echoes."""
    error = Path(folder) / f"rank{rank}.error"
    return error.stat().st_mtime if error.exists() else float("inf")


def merge(results: Sequence[RankResult]) -> RankResult:
    """One result from each rank's: buffers in rank order; the first problem any rank met."""
    merged = RankResult([rank for result in results for rank in result.ranks])
    first = results[0]
    for name, (layout, _) in first.outputs.items():
        merged.outputs[name] = (layout, [buffer for r in results for buffer in r.outputs[name][1]])
    for name, (layout, _) in first.gradients.items():
        merged.gradients[name] = (layout, [buffer for r in results for buffer in r.gradients[name][1]])
    merged.executed = first.executed
    merged.problem = next((r.problem for r in results if r.problem), None)
    if merged.problem is None and any(r.executed != first.executed for r in results):
        merged.problem = "the ranks executed different collectives"
    return merged
