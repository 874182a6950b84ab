"""Where prefill replicas run: local processes (default) or Ray actors.

A backend starts, feeds and stops numbered workers and reports what happened as `Event`s; it
never decides what to compute (the pool does). Each worker holds at most one task at a time.

Events: "ready" (loaded; payload: the replica's weights digest), "done" (payload: entry bytes),
"error" (the task raised in the worker; payload: the message), "dead" (the worker is gone: its
process exited or was killed, its actor died, or it failed to load; payload: why).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_connections
from typing import Any

from .replica import Replica, ReplicaSpec, Task

BACKENDS = ("processes", "ray")


@dataclass
class Event:
    kind: str  # "ready" | "done" | "error" | "dead"
    worker: int
    task: int | None = None
    payload: Any = None


class Backend:
    """Interface of a backend. Methods are called from one thread (the engine's)."""

    def start(self, worker: int) -> None:
        """Start (or restart) `worker`; it reports "ready" or "dead" later. Does not block on loading."""
        raise NotImplementedError

    def send(self, worker: int, task: Task) -> None:
        """Give an idle, ready `worker` a task; its answer comes back as an event."""
        raise NotImplementedError

    def events(self, timeout: float | None) -> list[Event]:
        """What happened since the last call, waiting up to `timeout` seconds (None: until something does)."""
        raise NotImplementedError

    def pid(self, worker: int) -> int | None:
        """The worker's process id, when known (tests kill it)."""
        raise NotImplementedError

    def stop(self, worker: int) -> None:
        """Stop `worker` (if running); it reports nothing more."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop every worker. Idempotent."""
        raise NotImplementedError


def _serve(conn, spec: ReplicaSpec, threads: int) -> None:
    """A worker process: load the replica, then answer tasks until the pipe closes."""
    try:
        replica = Replica(spec, threads)
    except BaseException as exc:  # noqa: BLE001 - reported to the pool, which stops using this worker
        conn.send(("dead", None, f"loading failed: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None, replica.weights))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            data = replica.compute(task)
        except Exception as exc:  # noqa: BLE001 - the pool recomputes it locally, where it raises for real
            conn.send(("error", task.id, f"{type(exc).__name__}: {exc}"))
        else:
            conn.send(("done", task.id, data))


class ProcessBackend(Backend):
    """Workers are spawned processes (never forked: the parent holds torch threads), one pipe each."""

    def __init__(self, spec: ReplicaSpec, threads: int):
        self.spec, self.threads = spec, threads
        self._ctx = mp.get_context("spawn")
        self._procs: dict[int, Any] = {}
        self._conns: dict[int, Any] = {}
        self._task: dict[int, int | None] = {}

    def start(self, worker: int) -> None:
        self.stop(worker)
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_serve, args=(child, self.spec, self.threads), daemon=True,
                                 name=f"hypic-prefill-{worker}")
        proc.start()
        child.close()
        self._procs[worker], self._conns[worker], self._task[worker] = proc, parent, None

    def send(self, worker: int, task: Task) -> None:
        self._task[worker] = task.id
        try:
            self._conns[worker].send(task)
        except (OSError, ValueError):
            pass  # the worker is dead: its sentinel reports it

    def events(self, timeout: float | None) -> list[Event]:
        if not self._conns:
            return []
        waitables = {}
        for w, conn in self._conns.items():
            waitables[conn] = w
            waitables[self._procs[w].sentinel] = w
        out: list[Event] = []
        dead: set[int] = set()
        for ready in wait_connections(list(waitables), timeout):
            w = waitables[ready]
            if w in dead or w not in self._conns:
                continue
            conn = self._conns[w]
            while True:  # read every message the pipe holds, even from a worker that just exited
                try:
                    if not conn.poll():
                        break
                    kind, task, payload = conn.recv()
                except (EOFError, OSError):
                    break
                if kind in ("done", "error"):
                    self._task[w] = None
                out.append(Event(kind, w, task, payload))
                if kind == "dead":
                    break
            if any(e.kind == "dead" and e.worker == w for e in out) or not self._procs[w].is_alive():
                dead.add(w)
        for w in dead:
            proc = self._procs[w]
            if not any(e.kind == "dead" and e.worker == w for e in out):
                proc.join(timeout=1)
                out.append(Event("dead", w, self._task.get(w), f"process exited with code {proc.exitcode}"))
            else:
                for e in out:
                    if e.kind == "dead" and e.worker == w:
                        e.task = self._task.get(w)
            self.stop(w)
        return out

    def pid(self, worker: int) -> int | None:
        proc = self._procs.get(worker)
        return proc.pid if proc is not None else None

    def stop(self, worker: int) -> None:
        conn, proc = self._conns.pop(worker, None), self._procs.pop(worker, None)
        self._task.pop(worker, None)
        if conn is not None:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
            conn.close()
        if proc is not None:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)

    def close(self) -> None:
        for w in list(self._procs):
            self.stop(w)


class _ReplicaActor:
    """The Ray actor: one replica; `compute` returns the entry bytes through the object store."""

    def __init__(self, spec: ReplicaSpec, threads: int):
        self.replica = Replica(spec, threads)

    def ready(self) -> tuple[int, str]:
        return os.getpid(), self.replica.weights

    def compute(self, task: Task) -> bytes:
        return self.replica.compute(task)


class RayBackend(Backend):
    """Workers are Ray actors, each reserving its threads as CPUs. Uses the Ray instance already
    initialised in this process, or starts a local one (`ray.init(address)` when `address` is set)."""

    def __init__(self, spec: ReplicaSpec, threads: int, address: str | None = None):
        import ray

        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.spec, self.threads = spec, threads
        self._cls = ray.remote(num_cpus=threads, max_restarts=0)(_ReplicaActor)
        self._actors: dict[int, Any] = {}
        self._pids: dict[int, int] = {}
        self._refs: dict[Any, tuple[int, int | None]] = {}  # ref -> (worker, task id or None for "ready")

    def start(self, worker: int) -> None:
        self.stop(worker)
        actor = self._cls.remote(self.spec, self.threads)
        self._actors[worker] = actor
        self._refs[actor.ready.remote()] = (worker, None)

    def send(self, worker: int, task: Task) -> None:
        self._refs[self._actors[worker].compute.remote(task)] = (worker, task.id)

    def actor(self, worker: int):
        return self._actors.get(worker)

    def events(self, timeout: float | None) -> list[Event]:
        ray = self._ray
        if not self._refs:
            return []
        done, _ = ray.wait(list(self._refs), num_returns=1, timeout=timeout)
        if done:  # and whatever else finished meanwhile
            done, _ = ray.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
        out = []
        for ref in done:
            worker, task = self._refs.pop(ref)
            if worker not in self._actors:
                continue
            try:
                value = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError, ray.exceptions.WorkerCrashedError) as exc:
                out.append(Event("dead", worker, task, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"))
                self.stop(worker)
                continue
            except ray.exceptions.RayTaskError as exc:
                out.append(Event("error", worker, task, str(exc).splitlines()[0]))
                continue
            if task is None:
                self._pids[worker], weights = value
                out.append(Event("ready", worker, None, weights))
            else:
                out.append(Event("done", worker, task, value))
        return out

    def pid(self, worker: int) -> int | None:
        return self._pids.get(worker)

    def stop(self, worker: int) -> None:
        actor = self._actors.pop(worker, None)
        self._pids.pop(worker, None)
        for ref, (w, _) in list(self._refs.items()):
            if w == worker:
                del self._refs[ref]
        if actor is not None:
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def close(self) -> None:
        for w in list(self._actors):
            self.stop(w)


def make_backend(name: str, spec: ReplicaSpec, threads: int, ray_address: str | None = None) -> Backend:
    if name == "processes":
        return ProcessBackend(spec, threads)
    if name == "ray":
        return RayBackend(spec, threads, ray_address)
    raise ValueError(f"prefill backend must be one of {', '.join(BACKENDS)}, got {name!r}")
