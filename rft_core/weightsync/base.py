"""One interface for every way weights move from the policy trainer to an inference copy
(``Transport``), the one record of where and how the two sides meet (``Meet``), and the
transports registered by name.

Every transport has the same two legs, each returning a ``SyncReport`` whose ``digest`` is the
weight digest (``rft_core.weightsync.digest``) of the weights as sent or as landed:

- ``send(tensors, plan, meet)``: the sender's leg (rank 0 of the trainer's gang);
- ``receive(plan, meet, landing)``: the receiver's leg, into a landing
  (``rft_core.weightsync.landing``: a model's tensors, or an engine's loader);
- ``finalize(meet)``: the sender frees what its send kept for the receiver (CUDA IPC buffers).

How the legs meet in time is the transport's ``handoff``: False (``gloo``, ``nccl``, the engine
transports), the two legs run together (a broadcast); True (``local``, ``shm``, ``cuda_ipc``), the
send finishes first and leaves the weights where the receiver takes them (its report's
``extra["handoff"]``, handed to the receiver as ``Meet.handoff``). Neither leg compares digests:
``rft_core.weightsync.session.pull`` runs the transaction (prepare, send and receive, verify,
finalize), the only caller of ``choose_transport`` and of ``receive``, and never returns weights
whose landed digest differs from the sent one.

Modelled on verl's ``checkpoint_engine/base.py`` (one interface over backends registered by
name, ``prepare`` / ``send_weights`` / ``receive_weights`` / ``finalize``, driven by one
``update_weights``). What this project keeps beyond it: the plan's fingerprint checked before a
byte moves, per-rank failure flags, an exact digest of what landed, a bounded wait on every
participant (``OWN_WAIT_SHARE``). This package imports neither the engines nor the workers: they
hand it what it needs (tensors, an engine object, the sender's leg).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from rft_core.weightsync.landing import Landing
from rft_core.weightsync.plan import SyncPlan, SyncReport, WeightSyncError


# Each participant's own waits in a transaction (its rendezvous, its collectives) get this share of the
# transaction's limit (``Transport.timeout_s``: ``orchestration.sync_timeout_s``); whoever waits on a participant
# from outside (vLLM's ``collective_rpc`` on its workers, the wait for the policy gang's send) waits the whole
# limit. A participant whose own wait ran out (a peer that never came) has reported by then, also through
# torch's whole-second rendezvous (a TCPStore master ends its wait for its clients at floor(timeout) + 1 s), for
# limits of 4 s and more; one that has not reported hangs (in NCCL's communicator setup, which no timeout of
# its own covers): the outside wait fails and ends it.
OWN_WAIT_SHARE = 0.75


@dataclass(frozen=True)
class Meet:
    """Where and how the two sides of one transaction meet: what the receiver's session hands the
    sender's ``send`` (through Ray: plain fields) and its own ``receive``.

    Args:
        transport: the chosen transport's name (``choose_transport``).
        dtype: the receiver's dtype (the plan's, for floating tensors; integer buffers keep theirs).
        version: what the weights are (the receiver's key of the policy version).
        backend: the sender's collective backend (``gloo`` from the CPU, ``nccl`` from a GPU).
        addr, port: where rank 0 hosts the rendezvous of a collective transport.
        world_size: 1 + the receiving ranks (an engine's tensor-parallel workers; 2 otherwise).
        handoff: a handoff transport's ``extra["handoff"]`` of the send (set by the session).
        adapters: the receiver keeps a LoRA policy's adapters on a base of its own
            (``Landing.adapters``): the sender sends its adapters only
            (``rft_core.weightsync.trained.adapter_tensors``), in their own dtype (``dtype`` is
            then theirs, float32).
    """

    transport: str
    dtype: str
    version: str = ""
    backend: str = "gloo"
    addr: str = "127.0.0.1"
    port: int = 0
    world_size: int = 2
    handoff: Any = None
    adapters: bool = False


def refuse_other_layout(plan: SyncPlan, handoff: Mapping[str, Any], *, buckets: bool = True) -> None:
    """Raise ``WeightSyncError`` unless the sender's plan, as its handoff describes it
    (``fingerprint``, and with ``buckets`` its ``bucket_sizes``: the receiver reads its buckets),
    is the receiver's ``plan``: the check a collective makes with its first message, before a
    byte lands."""
    if handoff.get("fingerprint") != plan.fingerprint() or (
            buckets and list(handoff.get("bucket_sizes", ())) != list(plan.bucket_sizes)):
        raise WeightSyncError("the sender's weights have another layout than the receiver's model (names, dtypes, "
                              "shapes or buckets differ): is the engine's model the policy's architecture?")


def handoff_of(plan: SyncPlan, **fields: Any) -> dict[str, Any]:
    """A handoff transport's ``extra["handoff"]``: ``fields`` and the plan's ``fingerprint`` and
    ``bucket_sizes`` (``refuse_other_layout``)."""
    return {"fingerprint": plan.fingerprint(), "bucket_sizes": list(plan.bucket_sizes), **fields}


def verify_digest(landed: str, sent: str | None, what: str) -> None:
    """Raise ``WeightSyncError`` unless the landed weights' digest equals the sent one.

    Args:
        landed, sent: the receiver's and the sender's ``SyncReport.digest``.
        what: the transaction in the message ("weight sync of <version>").
    """
    if landed != sent:
        raise WeightSyncError(f"{what}: the landed weights' digest {landed} differs from the sent {sent}")


class Transport(ABC):
    """One way weights move (see the module docstring). Subclasses set ``name`` (the registry
    key), ``device`` and ``upstream`` (what the docs' table says of them) and ``handoff``, and
    implement both legs.

    Args:
        timeout_s: the limit of a transaction (seconds): what a wait on a participant from outside
            allows; each of a participant's own waits gets ``own_wait_s``.
    """

    name: ClassVar[str]
    device: ClassVar[str]
    upstream: ClassVar[str]
    handoff: ClassVar[bool] = False

    def __init__(self, *, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s

    @property
    def own_wait_s(self) -> float:
        """The limit of each of a participant's own waits (``OWN_WAIT_SHARE`` of ``timeout_s``, seconds)."""
        return self.timeout_s * OWN_WAIT_SHARE

    def check(self, landing: Landing, what: str) -> None:
        """Receiver side, before the sender starts: refuse a landing this transport cannot reach
        (``WeightSyncError``); nothing by default."""

    @abstractmethod
    def send(self, tensors: Mapping[str, torch.Tensor], plan: SyncPlan, meet: Meet) -> SyncReport:
        """Sender side: move ``tensors`` (cast to the plan's dtypes) towards the receivers;
        returns the report whose digest is of the weights as sent (a handoff transport: with
        ``extra["handoff"]``, what the receiver takes them from).

        Raises:
            WeightSyncError: the tensors do not fit the plan, or the transfer failed or timed out.
        """

    @abstractmethod
    def receive(self, plan: SyncPlan, meet: Meet, landing: Landing) -> SyncReport:
        """Receiver side: land the weights into ``landing``; returns the report whose digest is
        of the weights as landed (the session compares it with the sent one).

        Raises:
            WeightSyncError: the transfer failed, timed out or the layouts differ (the landing is
                then invalid until a sync lands).
        """

    def finalize(self, meet: Meet) -> None:
        """Sender side, after the receiver took the weights: free what ``send`` kept for it."""

    def close(self) -> None:
        """Sender side, when its worker stops: free what this transport keeps across syncs (the
        ``shm`` segment); nothing by default."""


TRANSPORTS: dict[str, type[Transport]] = {}


def register(cls: type[Transport]) -> type[Transport]:
    """Class decorator: register a transport under its ``name``."""
    TRANSPORTS[cls.name] = cls
    return cls
