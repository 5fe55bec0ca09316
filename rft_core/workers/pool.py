"""The pool of resident workers of one training run, as named Ray actors.

``run_resident`` is what ``run_stage`` does for a stage whose runner says ``mode: resident``
(``TrainConfig.runner`` with ``orchestration.workers: resident``): it finds the worker of the
stage's role in the run's pool (started with the others when the run starts, ``start_run_workers``,
or on first use: a worker is started once per run and kept), sends it the stage input model and
returns the committed ShardRef. ``WORKER_CLASSES`` is
the one place a role's worker class is picked. The Prefect task and
the flow are unchanged: they still decide only where a program runs.

Workers are Ray actors named ``<role>-<sha of the pool name>`` (``-rank<r>`` after it for the
ranks above 0 of the policy trainer, ``orchestration.policy_ranks``, and of a DeepSpeed or FSDP2
critic, ``orchestration.critic_ranks``: data parallelism, every rank runs each of the role's
stages and rank 0's result is the stage's) in the namespace ``prefect-rft``
(a local Ray started on first use, or ``ray.address``), with the caller's torch thread count
and the Ray options of ``actor_options``: ``num_cpus=0`` (they run one stage at a time, as the
flow orders them) and, when the cluster has GPUs (``ray.cluster_resources()["GPU"]``), GPUs for
every model role (one each; the rollout engine's ``tensor_parallel_size`` for the rollout worker
of vLLM or SGLang; a fifth each when the whole cluster has one GPU, which the roles then share),
``ray.options`` overriding any of it per role. Where each actor landed (node id,
node IP, pid, GPU ids) is logged at INFO on ``rft_core.workers`` when it starts, which the run's task
log shows. An actor that Ray cannot place within ``RFT_WORKER_PLACEMENT_TIMEOUT_S`` seconds
(default 300: no node has the resources it asks for, e.g. its node died) fails with
``WorkerError`` naming the role, what it asks for, the live nodes and the node it last ran on.

A stage is handed to a gang right behind a ping the gang must answer within ``sync_timeout_s``
(``_start_answering``): one that does not is stuck in a call past its limit and is ended (the
stage's call with it) and started anew, which then runs the stage. A worker that died (killed, out of memory, its node gone) is replaced once per call and the
stage runs again: a committed stage is reused, an interrupted one recomputed, and the new
worker rebuilds its model (``rft_core.stages.recovery.rebuild_trainer``); a rank of a gang that dies or fails ends
its whole gang (its peers would wait in a collective), which is started anew the same way. Actors are owned by the process that
created them, so they end with it (Ctrl-C, SIGTERM, a crash); ``stop_workers`` ends them at the
end of a run.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Iterable

from rft_core.config import TrainConfig, WorkersConfig
from rft_core.counters import counts
from rft_core.workers.base import NAMESPACE, Gang, ResidentWorker, Started, WorkerError, actor_name
from rft_core.workers.critic import CriticWorker
from rft_core.workers.policy import PolicyWorker
from rft_core.workers.reference import ReferenceWorker
from rft_core.workers.rollout import RolloutWorker
from rft_core.workers.teacher import TeacherWorker
from schemas import PolicyRef

log = logging.getLogger("rft_core.workers")

# the worker class of each role: the one place a role's class is picked
WORKER_CLASSES: dict[str, type[ResidentWorker]] = {
    cls.role: cls for cls in (PolicyWorker, RolloutWorker, ReferenceWorker, CriticWorker, TeacherWorker)}
ROLES = tuple(WORKER_CLASSES)
# the stage programs of each role (its class's ``programs``), by program
ROLE_OF_PROGRAM = {program: role for role, cls in WORKER_CLASSES.items() for program in cls.programs}

# environment the workers need from the driver (a local Ray passes its own; a cluster does not): the project's,
# Hugging Face's, and object storage's (AWS_*: the credentials and endpoint an S3 run root is reached with,
# docs/reliability.md; FSSPEC_*: fsspec's configuration from the environment)
_ENV_PREFIXES = ("RFT_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "PREFECT_RFT_", "AWS_", "FSSPEC_")
# a cluster with one GPU: every role gets this share of it (all of ROLES fit; two workers on one
# GPU sync by CUDA IPC, rft_core/weightsync/cuda_ipc.py)
_SHARED_GPU = 1 / len(ROLES)
# held while Ray is connected or a gang is created or placed: stage tasks that run side by side
# (the actor and reference passes) never start one twice
_STARTING = threading.RLock()


def _ray(workers: WorkersConfig | None = None):
    """The ray module, connected (a local Ray started here, or ``workers.ray.address``). The
    driver's variables of ``_ENV_PREFIXES`` (the project's, Hugging Face's, object storage's:
    ``AWS_*`` credentials and endpoint) go to every worker as the job's ``runtime_env``
    ``env_vars`` (Ray's ``ray.init(runtime_env=...)``), under the user's own.

    Raises:
        WorkerError: Ray is not installed.
    """
    try:
        import ray  # lazy: Ray is optional (installed for the resident workers only)
    except ImportError as exc:
        raise WorkerError("orchestration.workers=resident needs Ray: pip install 'prefect-rft[ray]'") from exc
    with _STARTING:  # one ray.init per process, whichever stage task comes first
        if not ray.is_initialized():
            kw: dict[str, Any] = {"include_dashboard": False, "namespace": NAMESPACE, "log_to_driver": True}
            if workers is not None:
                kw.update(workers.ray.init_kwargs)
                if workers.ray.address:
                    kw["address"] = workers.ray.address
            env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
            if env:  # under the user's own runtime_env variables (ray.init_kwargs), which win
                runtime_env = dict(kw.get("runtime_env") or {})
                runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
                kw["runtime_env"] = runtime_env
            _HANDLES.clear()  # handles of an earlier connection: their actors ended with it
            _CREATED.clear()
            ray.init(**kw)
    return ray


def worker_handle(pool: str, role: str, rank: int = 0):
    """The live Ray actor of ``role`` (its rank ``rank``) in ``pool``, or None."""
    ray = _ray()
    try:
        return ray.get_actor(actor_name(pool, role, rank=rank), namespace=NAMESPACE)
    except ValueError:
        return None


# handles held by this process: a named actor that is not detached ends when no handle is left,
# so the process that starts a worker keeps its handle until stop_workers (or its own exit)
_HANDLES: dict[tuple[str, str, int], Any] = {}
# gangs ``create_workers`` created whose first ``start_gang`` has not come yet: (pool, role) -> (gang,
# its Ray options); their processes start meanwhile
_CREATED: dict[tuple[str, str], tuple[Gang, dict[str, Any]]] = {}


# where each started actor runs: (pool, role, rank) -> actor_placement's answer, kept after the
# actor died so that errors can name the node it was on
_PLACEMENT: dict[tuple[str, str, int], dict[str, Any]] = {}


def start_worker(workers: WorkersConfig, role: str):
    """The actor of ``role`` in the pool of ``workers`` (rank 0 of a gang of several ranks): the live
    one, or a new one (owned, and kept alive, by this process)."""
    return start_gang(workers, role)[0]


def actor_options(workers: WorkersConfig, role: str, *, cluster_gpus: float) -> dict[str, Any]:
    """The Ray actor options of each actor of ``role`` (every rank of a gang gets the same).

    Args:
        workers: the pool's settings; ``workers.ray.options[role]`` (``ray.options``)
            overrides any default key, e.g. ``{num_gpus: 0.5}`` or ``{resources: {node_a: 1}}``.
        role: one of ``ROLES``; all of them hold a model.
        cluster_gpus: ``ray.cluster_resources().get("GPU", 0)``, GPUs of the whole cluster.

    Returns:
        ``{"num_cpus": 0}`` plus, when ``cluster_gpus`` >= 1, ``num_gpus``: 1 per actor (the
        rollout worker: ``workers.rollout_gpus``, its engine's ``tensor_parallel_size``, whichever
        stage starts it, the rollout or the actor pass); on a one-GPU cluster ``1 / len(ROLES)`` (0.2), so every
        role fits on the one GPU; then the overrides.
    """
    options: dict[str, Any] = {"num_cpus": 0}
    if cluster_gpus >= 2:
        options["num_gpus"] = workers.rollout_gpus if role == "rollout" else 1
    elif cluster_gpus >= 1:
        options["num_gpus"] = _SHARED_GPU
    options.update(workers.ray.options.get(role, {}))
    return options


def actor_placement(_actor=None) -> dict[str, Any]:
    """Where the calling Ray worker process runs: node id and IP, the GPU ids Ray gave it
    (``ray.get_gpu_ids()``, what ``CUDA_VISIBLE_DEVICES`` lists) and its pid. Run inside an actor
    with ``actor.__ray_call__.remote(actor_placement)``."""
    import ray  # lazy: Ray is optional (installed for the resident workers only)

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}


def _where(pool: str, role: str, rank: int = 0) -> str:
    """'node <id> (<ip>)' of the last actor of ``role`` rank ``rank`` started in ``pool``, or ''."""
    p = _PLACEMENT.get((pool, role, rank))
    return f"node {p['node_id']} ({p['node_ip']})" if p else ""


def _placement_timeout_s() -> float:
    return float(os.environ.get("RFT_WORKER_PLACEMENT_TIMEOUT_S", "300"))


def _place(ray, workers: WorkersConfig, role: str, gang: list, options: dict[str, Any]) -> None:
    """Wait until Ray has placed every actor of a new gang, record and log where each runs.

    Raises:
        WorkerError: an actor was not placed within ``RFT_WORKER_PLACEMENT_TIMEOUT_S`` (naming the
            role, its options, the live nodes' resources and the node it last ran on).
    """
    futures = [a.__ray_call__.remote(actor_placement) for a in gang]
    ready, _ = ray.wait(futures, num_returns=len(futures), timeout=_placement_timeout_s())
    if len(ready) < len(futures):
        last = "; ".join(f"rank {r} last ran on {_where(workers.pool, role, r)}" for r in range(len(gang))
                         if _where(workers.pool, role, r))
        nodes = [f"{n['NodeID']} ({n['NodeManagerAddress']}): {n['Resources']}" for n in ray.nodes() if n["Alive"]]
        _kill_gang(workers.pool, role, gang)
        raise WorkerError(f"the {role} worker of {workers.pool} could not be placed within "
                          f"{_placement_timeout_s():.0f} s (RFT_WORKER_PLACEMENT_TIMEOUT_S): it asks for {options}; "
                          f"live nodes: {'; '.join(nodes)}" + (f"; {last}" if last else ""))
    for r, where in enumerate(ray.get(futures)):
        _PLACEMENT[(workers.pool, role, r)] = where
        log.info("resident worker %s%s of %s: node %s (%s), pid %s, GPUs %s, options %s", role, f" rank {r}" if r else "",
                 workers.pool, where["node_id"], where["node_ip"], where["pid"], where["gpus"] or "none", options)


def placements(pool: str) -> dict[str, dict[str, Any]]:
    """Where the actors of ``pool`` started by this process run (or last ran), by role
    (``policy-rank1`` for rank 1): ``actor_placement``'s answer."""
    return {role if r == 0 else f"{role}-rank{r}": where for (p, role, r), where in _PLACEMENT.copy().items()
            if p == pool}


def _gang_size(workers: WorkersConfig, role: str) -> int:
    """How many ranks the gang of ``role`` has: ``policy_ranks`` for the policy trainer,
    ``critic_ranks`` for the critic (both DeepSpeed or FSDP2 data parallelism), 1 for the others."""
    return {"policy": workers.policy_ranks, "critic": workers.critic_ranks}.get(role, 1)


def _held_gang(workers: WorkersConfig, role: str) -> Gang | None:
    """The gang of ``role`` whose every rank this process started and holds (the creating handles
    keep the actors alive), or None."""
    n = _gang_size(workers, role)
    if not all((workers.pool, role, r) in _HANDLES for r in range(n)):
        return None
    return Gang(WORKER_CLASSES[role], [_HANDLES[(workers.pool, role, r)] for r in range(n)])


def start_gang(workers: WorkersConfig, role: str) -> Gang:
    """Every rank's actor of ``role`` (its class: ``WORKER_CLASSES``): one for the rollout,
    reference and teacher workers, ``workers.policy_ranks`` for the policy trainer and
    ``workers.critic_ranks`` for the critic (DeepSpeed or FSDP2 data parallelism), with the Ray
    options of ``actor_options``: the gang this process holds, or the one ``create_workers``
    created (its processes started with the others), or a new one. A gang not held yet is placed
    (``_place``: logged, or ``WorkerError`` when Ray cannot place it), then the ranks of a
    gang of several are given one rendezvous
    (``ResidentWorker.rendezvous`` on rank 0, ``join`` on every rank: ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) before any program runs; the DeepSpeed or FSDP2
    process group is then formed on the first update and kept for the run. One thread starts a
    gang at a time (``_STARTING``): stages that ask for the same role at once get the same gang."""
    held = _held_gang(workers, role)
    if held is not None:
        return held
    with _STARTING:
        ray = _ray(workers)
        held = _held_gang(workers, role)
        if held is not None:  # another thread placed it while this one waited
            return held
        gang, options = _CREATED.pop((workers.pool, role), None) or _create_gang(ray, workers, role)
        _place(ray, workers, role, gang, options)
        if len(gang) > 1:
            gang.call(ResidentWorker.join, **gang.call(ResidentWorker.rendezvous))
        for r, a in enumerate(gang):
            _HANDLES[(workers.pool, role, r)] = a
        return gang


def create_workers(wanted: Iterable[tuple[WorkersConfig, str]]) -> list[str]:
    """Create the actors of the gangs ``wanted`` ((pool settings, role) pairs) that are neither
    held nor created yet, without waiting for any: Ray starts their processes side by side while
    the caller goes on, and the first ``start_gang`` of each role places the gang it finds here.
    Ray is connected first (``_ray``), in the calling thread. Returns the roles of ``wanted``.

    Raises:
        WorkerError: Ray is not installed.
    """
    roles = []
    with _STARTING:
        for workers, role in wanted:
            ray = _ray(workers)
            if _held_gang(workers, role) is None and (workers.pool, role) not in _CREATED:
                _CREATED[(workers.pool, role)] = _create_gang(ray, workers, role)
            roles.append(role)
    return roles


def start_run_workers(cfg: TrainConfig) -> list[str]:
    """Create the resident workers of ``cfg``'s first iteration (``TrainConfig.first_resident_stages``)
    together when the run starts (``create_workers``): their processes start side by side, during
    the run's first prompts, instead of one after another as each stage first needs its worker.
    The training flow calls it before its first iteration. Returns their roles, e.g.
    ``["rollout", "reference", "policy"]`` ([] in stage mode).

    Raises:
        WorkerError: Ray is not installed. (A worker that Ray cannot place fails the stage that
            needs it, ``start_gang``.)
    """
    wanted: dict[tuple[str, str], WorkersConfig] = {}
    for stage in cfg.first_resident_stages:
        workers = cfg.runner(stage).workers
        if workers is not None:  # a resident runner's pool (TrainConfig.runner sets it)
            wanted.setdefault((workers.pool, ROLE_OF_PROGRAM[stage]), workers)
    return create_workers((workers, role) for (_, role), workers in wanted.items())


def _create_gang(ray, workers: WorkersConfig, role: str) -> tuple[Gang, dict[str, Any]]:
    """The new actors of every rank of ``role`` (created, not waited for) and their Ray options."""
    cls, n = WORKER_CLASSES[role], _gang_size(workers, role)
    options = actor_options(workers, role, cluster_gpus=float(ray.cluster_resources().get("GPU", 0)))
    actor, kwargs = ray.remote(cls), cls.kwargs_from(workers)
    return Gang(cls, [actor.options(name=actor_name(workers.pool, role, rank=r), namespace=NAMESPACE,
                                    get_if_exists=True, max_restarts=0, **options).remote(
        workers.pool, rank=r, ranks=n, **kwargs) for r in range(n)]), options


def _kill_gang(pool: str, role: str, gang) -> None:
    """End every rank of a gang (one that died leaves the others stuck in their collectives) and
    forget its handles, so the next ``start_gang`` starts a new one. ``gang`` may be empty (the
    gang died before ``start_gang`` returned it): the handles this process holds are ended."""
    held = [_HANDLES.pop(key) for key in sorted(k for k in _HANDLES if k[:2] == (pool, role))]
    _CREATED.pop((pool, role), None)
    members = list(gang) or held
    if members:
        Gang(WORKER_CLASSES[role], members).kill()


def run_resident(inp, workers: WorkersConfig):
    """Run the stage program of ``inp`` in its resident worker (see the module docstring).

    Raises:
        WorkerError: no role runs ``inp.program``, or Ray cannot be reached.
        Whatever the program raises (re-raised from the worker), e.g. ``WeightSyncError``.
    """
    role = ROLE_OF_PROGRAM.get(inp.program)
    if role is None:
        raise WorkerError(f"no resident worker runs {inp.program!r}")
    _ray(workers)
    from ray.exceptions import RayActorError, RayTaskError  # lazy: Ray is optional

    for attempt in (0, 1):
        gang: Gang | list = []
        try:
            gang, started = _start_answering(workers, role, ResidentWorker.run, inp)  # an actor dying as it starts: below
            return gang.wait(started)  # every rank runs it; rank 0's result (FanOut.COLLECTIVE)
        except RayTaskError as exc:  # the program raised: the original exception, as the stage process would
            if len(gang) > 1:  # the other ranks may wait in a collective for the failed one
                _kill_gang(workers.pool, role, gang)
            raise exc.as_instanceof_cause() from None
        except RayActorError as exc:
            _kill_gang(workers.pool, role, gang)
            where = "; ".join(f"rank {r} on {_where(workers.pool, role, r) or 'an unknown node'}"
                              for r in range(_gang_size(workers, role)))
            if attempt:
                raise WorkerError(f"the {role} worker of {workers.pool} ({where}) died twice running {inp.program}: "
                                  f"{exc}") from exc
            log.warning("the %s worker (%s) died during %s (%s); starting a new one and running the stage again",
                        role, where, inp.program, exc)
    raise AssertionError("unreachable")


def sync_rollout_ahead(workers: WorkersConfig | None, policy: PolicyRef, dtype: str) -> bool:
    """Hand the rollout worker of ``workers``'s pool the policy version ``policy`` (a committed
    update) to sync into its copy in ``dtype`` on a thread of its own (``RolloutWorker.sync_ahead``),
    so the next rollout finds it held; returns at once, without waiting for the worker to take
    the call (a round trip of 10-20 ms on a 2-core CPU, on the critical path between an update
    and the iteration's end): the rollout worker runs it before the next rollout's call, which
    this process starts after it. A synchronous run's flow calls it right after each update but
    the last (``TrainConfig.syncs_rollout_ahead``). Returns whether it was handed over: not
    without resident workers (``workers`` None) or when this process has not started the rollout
    worker. A worker that died meanwhile fails the next rollout's call, which starts a new one
    (it loads or syncs the version itself). Raises nothing."""
    gang = _held_gang(workers, "rollout") if workers is not None else None
    if gang is None:
        return False
    gang.start(RolloutWorker.sync_ahead, policy, dtype)
    return True


def _start_answering(workers: WorkersConfig, role: str, method, *args: Any) -> tuple[Gang, Started]:
    """``start_gang``'s gang of ``role`` and ``method`` started on it (``Gang.start``; ``wait``
    takes the answer) right behind a ``ping`` the gang must answer within
    ``workers.sync_timeout_s``. The run of a stage has no limit of its own, but it waits behind
    whatever call the gang is busy with; no call a stage can find in front of it outlives
    ``sync_timeout_s`` (a weight sync; the stages of one role never overlap), so a gang that does
    not answer is stuck (a sync in NCCL's communicator setup whose peer died): it is ended, with
    the call queued behind the ping, and a new one started, which rebuilds its model as after a
    crash, and the call started there. A rank runs one caller's calls in the order they were
    started, so the ping answers once every call in front of it has ended and the call then runs
    at once: the check costs no round trip of its own (a ping answered before the call was
    started cost 3-18 ms per stage on a 2-core CPU, docs/benchmarks.md).

    Raises:
        ray.exceptions.RayActorError: a rank is dead.
    """
    gang = start_gang(workers, role)
    ping = gang.start(ResidentWorker.ping)
    started = gang.start(method, *args)
    if gang.answered(ping, workers.sync_timeout_s):
        return gang, started
    log.warning("the %s worker of %s did not answer within orchestration.sync_timeout_s (%g s): a call is stuck past "
                "its limit; ending it and starting a new one", role, workers.pool, workers.sync_timeout_s)
    _kill_gang(workers.pool, role, gang)
    gang = start_gang(workers, role)
    return gang, gang.start(method, *args)


def _live_gang(pool: str, role: str) -> Gang | None:
    """The live actors of ``role`` in ``pool``, rank 0 first (None: none)."""
    members, r = [], 0
    while True:
        handle = worker_handle(pool, role, rank=r)
        if handle is None:
            return Gang(WORKER_CLASSES[role], members) if members else None
        members.append(handle)
        r += 1


def worker_stats(pool: str) -> dict[str, dict[str, Any]]:
    """Each live worker's counters (``ResidentWorker.stats``), by role (``policy-rank1`` for
    rank 1); {} without Ray running."""
    try:
        import ray  # lazy: Ray is optional (installed for the resident workers only)
    except ImportError:
        return {}
    if not ray.is_initialized():
        return {}
    out = {}
    for role in ROLES:
        gang = _live_gang(pool, role)
        for r, stats in enumerate(gang.call(ResidentWorker.stats) if gang else []):
            out[role if r == 0 else f"{role}-rank{r}"] = stats
    return out


def run_counters(pool: str | None) -> dict[str, float]:
    """The event counters of a run so far (``rft_core.counters.counts``) summed over this
    process and, with ``pool`` (resident workers), its live workers: ``model_loads``,
    ``engine_builds``, ``weight_syncs``, ``weight_sync_seconds``, ``weight_sync_bytes``,
    ``recovered_updates``. Cumulative: the difference between two iterations is what the later
    one did."""
    total: dict[str, float] = dict(counts())
    for stats in (worker_stats(pool) if pool else {}).values():
        for k, v in stats.items():
            if isinstance(v, (int, float)) and k != "pid":
                total[k] = total.get(k, 0) + v
    return total


def stop_workers(pool: str) -> list[str]:
    """End the workers of ``pool`` (the roles that were started) after their pending writes;
    returns their roles.

    Raises:
        OptimizerStateError: a worker's pending optimizer-state write failed (the worker is
            stopped anyway; resuming the run recomputes that state).
    """
    try:
        import ray  # lazy: Ray is optional (installed for the resident workers only)
    except ImportError:
        return []
    if not ray.is_initialized():
        return []
    stopped = []
    for role in ROLES:
        gang = _live_gang(pool, role)
        if not gang:
            continue
        try:
            gang.call(ResidentWorker.close)  # pending optimizer-state writes first, on every rank
        finally:
            _kill_gang(pool, role, gang)
        stopped.append(role)
    if stopped:
        log.info("stopped the resident workers of %s: %s", pool, ", ".join(stopped))
    return stopped
