"""What every resident worker shares: the Ray actor plumbing (``ResidentWorker``: run a stage
program, stats, close, a gang's rendezvous) and the fan-out of a call across the ranks of a gang,
declared once per method (``fan_out``) and carried out by one dispatcher (``Gang``).

A role's worker is one Ray actor per rank of its gang: the policy trainer has
``orchestration.policy_ranks`` ranks and a DeepSpeed or FSDP2 critic ``orchestration.critic_ranks``
(data parallelism), the other roles one. How a
call to a gang reaches its ranks is a property of the method, not of the caller, so each method
that is called across a gang says it with ``@fan_out(...)``:

=============== ============================== ==========================================
``FanOut``      who runs it                    what the caller gets
=============== ============================== ==========================================
``COLLECTIVE``  every rank, together (they     rank 0's result; the first rank that fails
                meet in collectives: a ZeRO    raises at once (its peers may wait forever
                gather, a DeepSpeed step)      in a collective)
``RANK0``       rank 0 alone                   its result
``EACH``        every rank, on its own         every rank's result, rank 0 first, after
                                               all of them
=============== ============================== ==========================================

``Gang.call`` / ``Gang.start`` + ``Gang.wait`` take the method itself, not its name
(``gang.call(PolicyWorker.prepare_weights, ref)``), so a reader, an IDE and a static call graph
follow a call from its caller to the worker's method; they read the method's mode from its
declaration and do the rest; a method without a declaration cannot be called across a gang, nor
one the gang's class does not have. Modelled on
verl's ``single_controller`` (``verl/single_controller/base/decorator.py``: ``@register`` with a
dispatch and an execute mode, read by the worker group), reduced to the three modes this project
uses and Ray actor handles (or, in tests and the no-Ray driver, the worker objects themselves).
"""
from __future__ import annotations

import enum
import hashlib
import os
import time
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Callable, ClassVar, Iterator

import torch

from rft_core.config import WorkersConfig
from rft_core.counters import counts
from rft_core.heap import freeze_grown_heap
from rft_core.network import free_port
from rft_core.stages.inprocess import run_in_process
from rft_core.stages.sources import models_from
from rft_core.weightsync.collective import host_address

NAMESPACE = "prefect-rft"  # the Ray namespace of the workers


class WorkerError(RuntimeError):
    """A resident worker could not be started or reached (Ray missing, cluster unreachable, a
    peer that is not running)."""


# torch.distributed's env:// rendezvous: set on each rank of a gang by ``ResidentWorker.join``
RENDEZVOUS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def actor_name(pool: str, role: str, rank: int = 0) -> str:
    """The Ray actor name of ``role`` (its rank ``rank``: the policy trainer's or the sharded
    critic's data-parallel ranks) in the pool ``pool`` (the run root)."""
    name = f"{role}-{hashlib.sha256(pool.encode()).hexdigest()[:16]}"
    return name if rank == 0 else f"{name}-rank{rank}"


# -- the fan-out declaration ------------------------------------------------------------------


class FanOut(enum.Enum):
    """How a call to a gang's method reaches its ranks (the table of the module docstring)."""

    COLLECTIVE = "every rank, together; rank 0's result, the first failure at once"
    RANK0 = "rank 0 alone; its result"
    EACH = "every rank on its own; every rank's result, after all of them"


def fan_out(mode: FanOut) -> Callable[[Callable], Callable]:
    """Method decorator: declare how a call of this method across a gang fans out (``FanOut``).
    Marks the method only (its ``fan_out`` attribute); ``Gang`` reads it."""
    def mark(method: Callable) -> Callable:
        method.fan_out = mode  # type: ignore[attr-defined]
        return method
    return mark


def fan_out_of(cls: type, method: str) -> FanOut:
    """The declared ``FanOut`` of ``cls.method``.

    Raises:
        TypeError: ``cls`` has no such method, or it declares no fan-out.
    """
    mode = getattr(getattr(cls, method, None), "fan_out", None)
    if not isinstance(mode, FanOut):
        raise TypeError(f"{cls.__name__}.{method} declares no fan-out (@fan_out): it cannot be called across a gang")
    return mode


def method_name(cls: type, method: Callable) -> str:
    """The name under which ``cls`` (or a class it inherits from) defines the function ``method``
    (``PolicyWorker.prepare_weights``, as written at the call site).

    Raises:
        TypeError: ``method`` is a name (a string), or a function ``cls`` does not have.
    """
    name = getattr(method, "__name__", None)
    if isinstance(method, str) or name is None:
        raise TypeError(f"a gang is called with the method itself ({cls.__name__}.<method>), not {method!r}")
    if not any(vars(c).get(name) is method for c in cls.__mro__):
        raise TypeError(f"{getattr(method, '__qualname__', name)} is not a method of {cls.__name__}")
    return name


@dataclass
class Started:
    """Calls a ``Gang`` started (``Gang.start``): the method's mode and one Ray object ref per rank called."""

    mode: FanOut
    futures: list


class Gang(Sequence):
    """The ranks of one role's worker, rank 0 first: Ray actor handles, or (tests, the no-Ray
    driver) the worker objects themselves (``local``). Calls fan out as each method declares
    (``fan_out``).

    Args:
        cls: the role's worker class (where the declarations are read).
        members: one per rank, rank 0 first.
        timeout_s: the limit of a wait for a call's results (None: none).
    """

    def __init__(self, cls: type, members: Sequence, *, timeout_s: float | None = None) -> None:
        if not members:
            raise ValueError(f"a gang of {cls.__name__} needs at least one rank")
        self.cls, self.members, self.timeout_s = cls, list(members), timeout_s

    @classmethod
    def named(cls, worker_cls: type, pool: str, ranks: int, *, timeout_s: float | None = None) -> "Gang":
        """The running Ray actors of ``worker_cls.role`` in ``pool`` (``ranks`` of them), by name.

        Raises:
            WorkerError: a rank is not running.
        """
        import ray  # lazy: Ray is only needed when the workers are Ray actors

        members = []
        for r in range(ranks):
            try:
                members.append(ray.get_actor(actor_name(pool, worker_cls.role, rank=r), namespace=NAMESPACE))
            except ValueError:
                raise WorkerError(f"the {worker_cls.role} worker of {pool}"
                                  f"{f' (rank {r})' if r else ''} is not running") from None
        return cls(worker_cls, members, timeout_s=timeout_s)

    def __getitem__(self, rank):  # type: ignore[override]
        return self.members[rank]

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator:
        return iter(self.members)

    @property
    def local(self) -> bool:
        """Whether the ranks are worker objects of this process (no Ray)."""
        return isinstance(self.members[0], self.cls)

    def _targets(self, mode: FanOut) -> list:
        return self.members[:1] if mode is FanOut.RANK0 else self.members

    def call(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` (the function as its class defines it: ``gang.call(PolicyWorker.
        prepare_weights, ref)``) on the gang as it declares and return what its mode returns (the
        table of the module docstring). Each rank runs its own class's method of that name.

        Raises:
            TypeError: ``method`` is not a method of the gang's class, or declares no fan-out.
            Whatever a rank raised; ``ray.exceptions.GetTimeoutError`` after ``timeout_s``.
        """
        if self.local:
            name = method_name(self.cls, method)
            mode = fan_out_of(self.cls, name)
            results = [getattr(m, name)(*args, **kwargs) for m in self._targets(mode)]
            return results if mode is FanOut.EACH else results[0]
        return self.wait(self.start(method, *args, **kwargs))

    def start(self, method: Callable, *args: Any, **kwargs: Any) -> Started:
        """Start ``method`` (as for ``call``) on the ranks its mode names (Ray actors only;
        ``wait`` takes the answer).

        Raises:
            TypeError: ``method`` is not a method of the gang's class, or declares no fan-out.
            WorkerError: the ranks are objects of this process (their calls cannot run alongside the caller).
        """
        name = method_name(self.cls, method)
        mode = fan_out_of(self.cls, name)
        if self.local:
            raise WorkerError(f"{self.cls.__name__}.{name} cannot be started alongside the caller in one process: "
                              "run the workers as Ray actors (rft_core.workers.pool)")
        return Started(mode, [getattr(m, name).remote(*args, **kwargs) for m in self._targets(mode)])

    def wait(self, started: Started) -> Any:
        """The answer of ``start``'s calls as their mode says (the module docstring's table).

        Raises:
            Whatever a rank raised; ``ray.exceptions.GetTimeoutError`` after ``timeout_s``.
        """
        import ray  # lazy: Ray is only needed when the workers are Ray actors

        if started.mode is FanOut.COLLECTIVE:
            return _first_failure_or_all(ray, started.futures, self.timeout_s)[0]
        results = ray.get(started.futures, timeout=self.timeout_s)
        return results if started.mode is FanOut.EACH else results[0]

    def answers(self, timeout_s: float) -> bool:
        """Whether every rank answers a ``ping`` within ``timeout_s`` seconds. A rank runs its
        calls one at a time, so one still busy with a call stuck past its limit (a sync in NCCL's
        communicator setup whose peer is gone) does not; a dead rank raises Ray's
        ``RayActorError``. Ranks in this process always answer."""
        if self.local:
            return True
        return self.answered(self.start(self.cls.ping), timeout_s)

    def answered(self, ping: Started, timeout_s: float) -> bool:
        """Whether every rank answered the ``ping`` this gang started (``start``) within
        ``timeout_s`` seconds (``answers``), e.g. a ping started right in front of a call: a rank
        runs the calls of one caller in the order they were started, so the call then waits
        behind nothing stuck. A dead rank raises Ray's ``RayActorError``."""
        from ray.exceptions import GetTimeoutError  # lazy: Ray is only needed when the workers are Ray actors

        try:
            Gang(self.cls, self.members, timeout_s=timeout_s).wait(ping)
        except GetTimeoutError:
            return False
        return True

    def kill(self) -> None:
        """End every rank (``ray.kill``): what ends a call stuck past its limit, since Ray cannot
        interrupt a running call of an actor (``ray.cancel`` only drops calls not yet started).
        The pool then starts a new gang on its next call, which rebuilds its model as after a
        crash (``rft_core.workers.pool.run_resident``). Ranks in this process: nothing to end."""
        if self.local:
            return
        import ray  # lazy: Ray is only needed when the workers are Ray actors

        for member in self.members:
            try:
                ray.kill(member)
            except Exception:  # noqa: BLE001  already gone
                pass


def _first_failure_or_all(ray, futures: list, timeout_s: float | None) -> list:
    """Every future's result; the first one that fails raises at once (its peers may be blocked
    in a collective that will never complete).

    Raises:
        ray.exceptions.GetTimeoutError: not all done within ``timeout_s`` seconds.
    """
    from ray.exceptions import GetTimeoutError  # lazy: Ray is only needed when the workers are Ray actors

    pending = list(futures)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            raise GetTimeoutError(f"{len(pending)} of {len(futures)} ranks did not answer within {timeout_s} s")
        ray.get(done[0])  # raises the rank's error
    return ray.get(futures)


# -- the shared base ----------------------------------------------------------------------------


class ResidentWorker:
    """The body of one rank of a resident worker: what every role shares. Subclasses set
    ``role`` and ``programs`` (the stage programs it runs) and implement the part of
    ``rft_core.stages.sources.ModelSource`` that those programs call. ``version`` is the
    ``version_key`` of the model the worker holds (None: none yet, or invalid); each role
    documents which model that is. Plain Python (tests drive it in-process); ``rft_core.workers.pool`` runs it
    as a Ray actor.

    Args:
        pool: the pool's name (the run root).
        rank, ranks: this worker's rank in its role's gang and the gang's size (the policy
            trainer's and a sharded critic's ranks; 1 for the other roles).
        threads: torch threads (None: leave torch's setting). The same count as a stage-mode run
            keeps CPU results bit-identical.
        keep_device_cache: keep the CUDA caching allocator's blocks between programs
            (``ModelSource.keeps_device_cache``, ``rft_core.stages.sources.release_models``); False
            when a GPU engine (vLLM, SGLang) shares the devices and must find their memory free.
        freeze_heap: after each program, freeze the process's heap once it has grown
            (``rft_core.heap.freeze_grown_heap``: the first program's imports and models), so the
            garbage collector's walks of the oldest generation stop pausing the next programs:
            for a worker in a process of its own (a Ray actor, ``kwargs_from``); False for one
            made in the caller's process (tests, ``tests.drive``'s caller freezes its own heap).
    """

    role: ClassVar[str]
    programs: ClassVar[tuple[str, ...]]

    def __init__(self, pool: str, *, rank: int = 0, ranks: int = 1, threads: int | None = None,
                 keep_device_cache: bool = True, freeze_heap: bool = False) -> None:
        if threads:
            torch.set_num_threads(threads)
        for name in RENDEZVOUS_ENV:  # the driver's (its own process group, a torchrun launch), inherited through
            os.environ.pop(name, None)  # Ray: a one-rank trainer forms its own world (``prepare_rank``), a gang ``join``s
        self.pool, self.rank, self.ranks = pool, rank, ranks
        self.keeps_device_cache, self.freeze_heap = keep_device_cache, freeze_heap
        self.version: str | None = None

    @classmethod
    def kwargs_from(cls, workers: WorkersConfig) -> dict[str, Any]:
        """The constructor's keyword arguments (beyond ``pool``, ``rank``, ``ranks``) of a Ray actor
        from the pool's settings (the actor's process is its own: ``freeze_heap``)."""
        return {"threads": workers.threads or torch.get_num_threads(), "keep_device_cache": workers.keep_device_cache,
                "freeze_heap": True}

    @fan_out(FanOut.COLLECTIVE)
    def run(self, inp) -> Any:
        """Run the stage program of ``inp`` (a stage input model) exactly as ``run_stage`` does in
        a stage process, inside ``models_from(self)`` (the program asks this worker for its
        model instead of loading it); returns what the program returns (its committed ShardRef).
        Every rank of a gang runs it; rank 0's result is the stage's. Then, with ``freeze_heap``,
        the heap is frozen if it grew (``freeze_grown_heap``: after the worker's first program).

        Raises:
            ValueError: a program this role does not run.
        """
        if inp.program not in self.programs:
            raise ValueError(f"the {self.role} worker does not run {inp.program!r} (it runs {', '.join(self.programs)})")
        with models_from(self):  # type: ignore[arg-type]  # the part of ModelSource this role's programs call
            out = run_in_process(inp)
        if self.freeze_heap:
            freeze_grown_heap()
        return out

    @fan_out(FanOut.EACH)
    def stats(self) -> dict[str, Any]:
        """This worker's counters (``rft_core.counters.counts``), its pid, role and the
        version it holds."""
        return {**counts(), "role": self.role, "pid": os.getpid(), "version": self.version}

    @fan_out(FanOut.EACH)
    def close(self) -> None:
        """Finish what this worker still has to do before it is stopped: nothing here; a role
        with background work overrides it (the policy's optimizer-state and checkpoint writes,
        ``rft_core.workers.policy.PolicyWorker.close``)."""

    @fan_out(FanOut.EACH)
    def ping(self) -> int:
        """The worker's pid (a liveness check: tests/rft_core/training/test_deepspeed_update.py)."""
        return os.getpid()

    @fan_out(FanOut.RANK0)
    def rendezvous(self) -> dict[str, Any]:
        """Where the ranks of a new gang meet (this is rank 0): an address of this host and a free port."""
        return {"addr": host_address(), "port": free_port()}

    @fan_out(FanOut.EACH)
    def join(self, addr: str, port: int) -> None:
        """Set this rank's torch.distributed environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT``, ``LOCAL_RANK=0`` since Ray gives each actor its own GPUs) before its
        first update forms DeepSpeed's process group (``init_distributed``)."""
        os.environ.update({"RANK": str(self.rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(self.ranks),
                           "MASTER_ADDR": addr, "MASTER_PORT": str(port)})
