"""The fan-out of a call across a gang's ranks (``rft_core.workers.base``: ``fan_out``, ``Gang``):
each mode reaches the ranks it names and returns what it says, in one process and across Ray
actors; a collective's first failing rank raises at once while its peer still runs; a method
without a declaration cannot be called across a gang; every method the workers call across a gang
declares its mode, every such call names the method itself (no string dispatch), and a role's
class has only the methods of its role."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from rft_core.workers.base import FanOut, Gang, ResidentWorker, WorkerError, fan_out, fan_out_of
from rft_core.workers.critic import CriticWorker
from rft_core.workers.policy import PolicyWorker
from rft_core.workers.pool import ROLE_OF_PROGRAM, WORKER_CLASSES
from rft_core.workers.reference import ReferenceWorker
from rft_core.workers.rollout import RolloutWorker
from rft_core.workers.teacher import TeacherWorker

WORKERS = Path(__file__).resolve().parents[3] / "rft_core" / "workers"
WEIGHTSYNC = WORKERS.parent / "weightsync"


class Ranks:
    """A worker with one method per mode; each records how often it was called."""

    def __init__(self, rank: int) -> None:
        self.rank, self.calls = rank, 0

    @fan_out(FanOut.COLLECTIVE)
    def together(self, fail_rank: int | None = None, sleep_s: float = 0.0) -> int:
        self.calls += 1
        if self.rank == fail_rank:
            raise ValueError(f"rank {self.rank} failed")
        time.sleep(sleep_s)
        return 10 + self.rank

    @fan_out(FanOut.RANK0)
    def first(self) -> int:
        self.calls += 1
        return 10 + self.rank

    @fan_out(FanOut.EACH)
    def each(self) -> int:
        self.calls += 1
        return 10 + self.rank

    @fan_out(FanOut.EACH)
    def ping(self) -> int:
        return self.rank

    def undeclared(self) -> int:
        return self.rank

    def count(self) -> int:
        return self.calls


def test_in_process_gang_calls_the_ranks_each_mode_names():
    ranks = [Ranks(0), Ranks(1)]
    gang = Gang(Ranks, ranks)
    assert gang.local and len(gang) == 2 and gang[1] is ranks[1]
    assert gang.call(Ranks.first) == 10 and [r.calls for r in ranks] == [1, 0]  # rank 0 alone
    assert gang.call(Ranks.each) == [10, 11] and [r.calls for r in ranks] == [2, 1]
    assert gang.call(Ranks.together) == 10 and [r.calls for r in ranks] == [3, 2]  # every rank, rank 0's answer
    with pytest.raises(TypeError, match=r"Ranks.undeclared declares no fan-out"):
        gang.call(Ranks.undeclared)
    with pytest.raises(TypeError, match=r"with the method itself \(Ranks.<method>\), not 'each'"):
        gang.call("each")  # a name: nothing a reader or a call graph could follow
    with pytest.raises(TypeError, match=r"PolicyWorker.prepare_weights is not a method of Ranks"):
        gang.call(PolicyWorker.prepare_weights)
    with pytest.raises(WorkerError, match="cannot be started alongside the caller"):
        gang.start(Ranks.each)
    with pytest.raises(ValueError, match="at least one rank"):
        Gang(Ranks, [])


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="test-fan-out")
    yield ray
    if started:
        ray.shutdown()


def _actors(ray, n: int = 2) -> list:
    actor = ray.remote(Ranks)
    return [actor.options(num_cpus=0).remote(r) for r in range(n)]


def test_ray_gang_calls_the_ranks_each_mode_names(ray_session):
    ray = ray_session
    members = _actors(ray)
    gang = Gang(Ranks, members, timeout_s=60)
    assert not gang.local
    assert gang.call(Ranks.first) == 10
    assert ray.get([m.count.remote() for m in members]) == [1, 0]
    assert gang.call(Ranks.each) == [10, 11]
    assert gang.call(Ranks.together) == 10
    assert ray.get([m.count.remote() for m in members]) == [3, 2]
    started = gang.start(Ranks.together)
    assert started.mode is FanOut.COLLECTIVE and len(started.futures) == 2 and gang.wait(started) == 10


@pytest.mark.rotation(3)  # long: one turn in 8 (tests/rotation.py); the gang's timeout test runs every time
def test_a_collective_raises_the_first_failure_while_its_peer_still_runs(ray_session):
    ray = ray_session
    gang = Gang(Ranks, _actors(ray), timeout_s=60)
    gang.call(Ranks.each)  # both actors up before the clock starts
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="rank 1 failed"):
        gang.call(Ranks.together, 1, 30.0)  # rank 0 sleeps 30 s, as a peer stuck in a collective would
    assert time.perf_counter() - t0 < 15


def test_a_gang_wait_gives_up_after_its_timeout(ray_session):
    ray = ray_session
    from ray.exceptions import GetTimeoutError

    members = _actors(ray)
    Gang(Ranks, members, timeout_s=60).call(Ranks.each)  # both actors up before the clock starts
    gang = Gang(Ranks, members, timeout_s=1.0)
    t0 = time.perf_counter()
    with pytest.raises(GetTimeoutError, match="2 of 2 ranks did not answer within 1.0 s"):
        gang.call(Ranks.together, None, 20.0)
    assert time.perf_counter() - t0 < 10


@pytest.mark.rotation(0)  # long: one turn in 8 (tests/rotation.py); the gang's timeout test runs every time
def test_a_gang_busy_past_a_limit_does_not_answer_and_is_killed(ray_session):
    """Issue 45, finding 2: the run of a stage has no limit of its own, so before a stage is handed
    to a gang (``rft_core.workers.pool._start_answering``) the gang must answer a ping within the
    sync's limit. A rank stuck in a call (20 s here, as a sync stuck in NCCL's communicator setup)
    does not answer within it; ``kill`` ends the ranks, which Ray cannot interrupt otherwise."""
    ray = ray_session
    from ray.exceptions import RayActorError

    members = _actors(ray)
    gang = Gang(Ranks, members, timeout_s=60)
    gang.call(Ranks.each)  # both actors up before the clock starts
    assert gang.answers(5.0)
    gang.start(Ranks.together, None, 20.0)  # both ranks busy for 20 s
    t0 = time.perf_counter()
    assert not gang.answers(1.0) and time.perf_counter() - t0 < 10
    gang.kill()
    with pytest.raises(RayActorError):
        ray.get(members[0].count.remote(), timeout=30)


def test_a_call_started_behind_a_ping_waits_for_the_call_in_front(ray_session):
    """``rft_core.workers.pool._start_answering`` starts a stage's call right behind the ping that
    checks the gang: a rank runs one caller's calls in the order they were started, so the ping
    answers only once the call in front of it (busy 2 s) has ended, not within 0.5 s, and the
    call behind it then answers with its own result."""
    ray = ray_session
    members = _actors(ray)
    gang = Gang(Ranks, members, timeout_s=60)
    gang.call(Ranks.each)  # both actors up before the clock starts
    gang.start(Ranks.together, None, 2.0)  # both ranks busy for 2 s
    t0 = time.perf_counter()
    ping, started = gang.start(Ranks.ping), gang.start(Ranks.first)
    assert not gang.answered(ping, 0.5)
    assert gang.answered(ping, 30.0) and time.perf_counter() - t0 >= 1.9
    assert gang.wait(started) == 10 and ray.get([m.count.remote() for m in members]) == [3, 2]


def test_every_method_called_across_a_gang_declares_its_fan_out():
    """Issue 46: every gang call in the workers and the weight sync names the method itself
    (``gang.call(PolicyWorker.prepare_weights, ...)``), never its name in a string."""
    called, sources = set(), [*WORKERS.glob("*.py"), *WEIGHTSYNC.glob("*.py")]
    for path in sources:
        text = path.read_text()
        assert not re.search(r"\.(?:call|start)\(\s*[\"']", text), f"string dispatch in {path.name}"
        called |= set(re.findall(r"(?:\.(?:call|start)\(|_start_answering\([^()]*?,\s*)(\w+)\.(\w+)\b", text))
    assert {("ResidentWorker", m) for m in ("run", "stats", "close", "rendezvous", "join")} | {
        ("PolicyWorker", m) for m in ("prepare_weights", "send_weights", "finish_send")} <= called
    classes = {**{c.__name__: c for c in WORKER_CLASSES.values()}, "ResidentWorker": ResidentWorker}
    for cls, name in called - {("self", "cls")}:
        assert isinstance(getattr(getattr(classes[cls], name), "fan_out", None), FanOut), (cls, name)
    # the policy's side of a sync is a collective: a ZeRO-3 gather or a rebuild needs every rank
    for name in ("prepare_weights", "send_weights"):
        assert fan_out_of(PolicyWorker, name) is FanOut.COLLECTIVE
    assert fan_out_of(PolicyWorker, "finish_send") is FanOut.RANK0
    assert fan_out_of(PolicyWorker, "rendezvous") is FanOut.RANK0 and fan_out_of(PolicyWorker, "close") is FanOut.EACH


def test_one_class_per_role_with_only_its_roles_methods():
    assert {r: c.__name__ for r, c in WORKER_CLASSES.items()} == {
        "policy": "PolicyWorker", "rollout": "RolloutWorker", "reference": "ReferenceWorker", "critic": "CriticWorker",
        "teacher": "TeacherWorker"}
    assert ROLE_OF_PROGRAM == {"ppo_update": "policy", "rollout": "rollout", "actor_logprobs": "rollout",
                               "ref_logprobs": "reference", "critic_values": "critic", "critic_update": "critic",
                               "teacher_logprobs": "teacher"}
    serves = {PolicyWorker: {"trainer", "trained", "prepare_weights", "send_weights", "finish_send"},
              RolloutWorker: {"inference_model", "engine_policy"}, ReferenceWorker: {"inference_model"},
              CriticWorker: {"critic_model", "critic_strategy", "critic_trained"}, TeacherWorker: {"inference_model"}}
    every = set().union(*serves.values())
    for cls, own in serves.items():
        assert {m for m in every if hasattr(cls, m)} == own, cls.__name__
    with pytest.raises(ValueError, match="the reference worker holds the reference model, not the policy"):
        ReferenceWorker("p").inference_model("/m", dtype="float32", role="policy")
    with pytest.raises(ValueError, match="the teacher worker holds the teacher model, not the reference"):
        TeacherWorker("p").inference_model("/m", dtype="float32", role="reference")
    with pytest.raises(ValueError, match="the rollout worker holds the policy, not the reference"):
        RolloutWorker("p").inference_model("/m", dtype="float32", role="reference")
