"""One interface for every way weights move from the policy trainer to an inference copy, the
transports registered by name, and the one place that picks a transport from the two ends.

A transaction over any transport:

- the sender (rank 0 of the trainer) ``prepare``s its weights for the transport (CUDA IPC:
  packs and shares its buckets; the others need nothing before the transfer);
- the sender ``send``s them (the collective transports: a broadcast to the receivers);
- the receiver ``receive``s them into its own tensors (``state_tensors`` of its model) or into
  an engine (vLLM, SGLang: their own loaders), drives the sender's side through a ``Sender``
  handle, and checks the sent and landed checksums (``verify_digest``): a transport never
  returns weights it has not verified;
- the sender ``finalize``s (CUDA IPC: frees the shared buffers).

Every transaction carries the plan (``rft_core.weightsync.plan.SyncPlan``: names, dtypes,
shapes, buckets), the checksum (``rft_core.weightsync.checksum``) and the timeout
(``Transport.timeout_s``, each collective's limit). The transports and when each is chosen are
tabled in docs/architecture.md ("Weight sync"); ``rft_core.weightsync.choose.choose_transport``
is that table in code.

Modelled on verl's ``checkpoint_engine/base.py`` (one interface, ``prepare`` / ``send_weights``
/ ``receive_weights`` / ``finalize``, backends registered by name). This package imports neither
the engines nor the workers: they hand it what it needs (tensors, an engine object, a
``Sender``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Mapping, Protocol

import torch

from rft_core.weightsync.plan import SyncPlan, SyncReport, WeightSyncError


# Each participant's own waits in a transaction (its rendezvous, its collectives) get this share of the
# transaction's limit (``Transport.timeout_s``: ``orchestration.sync_timeout_s``); whoever waits on a participant
# from outside (vLLM's ``collective_rpc`` on its workers, the wait for the policy gang's send) waits the whole
# limit. A participant whose own wait ran out (a peer that never came) has reported by then, also through
# torch's whole-second rendezvous (a TCPStore master ends its wait for its clients at floor(timeout) + 1 s), for
# limits of 4 s and more; one that has not reported hangs (in NCCL's communicator setup, which no timeout of
# its own covers): the outside wait fails and ends it.
OWN_WAIT_SHARE = 0.75


class Sender(Protocol):
    """The receiver's handle on the sending side of one transaction (the policy trainer's ranks,
    in this process or as Ray actors), bound to the version being synced. A transport calls
    only the methods it needs."""

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The sender's weights as an inference copy holds them (``local``: same process only)."""

    def start(self, **meet: Any) -> Any:
        """Start the sender's ``send`` on every rank (``addr``, ``port``, ``dtype``, ``backend``,
        ``world_size``); returns what ``wait`` and ``cancel`` take."""

    def wait(self, started: Any) -> dict[str, Any]:
        """The sender's report of a started send (``digest``/``checksum``, ``bytes``, ...);
        raises when it failed."""

    def cancel(self, started: Any) -> None:
        """End a started send that outlived its limit (``settle``)."""

    def export(self) -> dict[str, Any]:
        """The sender's ``prepare`` answer of a CUDA IPC transaction (``handles``, ``digest``)."""

    def release(self) -> None:
        """The sender's ``finalize`` (CUDA IPC: free the exported buffers)."""


def settle(sender: Sender, started: Any) -> str:
    """After the receiver's side of a transaction failed: wait for the sender's started send
    (``sender.wait``, bounded by the sender's own limit, ``sync_timeout_s``: its collectives fail
    on their own within it once the receiver is gone), so that it is not left running into the
    sender's next call. A send whose wait times out (``TimeoutError``; Ray's ``GetTimeoutError``
    is one) is stuck past every limit of the transaction (in NCCL's communicator setup, which no
    timeout covers): it is cancelled (``sender.cancel``; the policy gang's ends its ranks, since
    Ray cannot interrupt a running call). Returns what became of the send, for the receiver's
    error message; raises nothing."""
    try:
        sender.wait(started)
        return "the sender finished its send"
    except TimeoutError as exc:
        sender.cancel(started)
        return f"the sender was still sending past its limit and was ended ({exc})"
    except Exception as exc:  # noqa: BLE001  expected: the sender failed too; the receiver's error is the one raised
        return f"the sender failed too: {type(exc).__name__}: {exc}"


def verify_digest(landed: str, sent: str | None, what: str) -> None:
    """Raise ``WeightSyncError`` unless the landed weights' checksum equals the sent one.

    Args:
        landed, sent: the receiver's and the sender's ``SyncReport.digest``.
        what: the transaction in the message ("weight sync of <version>").
    """
    if landed != sent:
        raise WeightSyncError(f"{what}: the landed weights' digest {landed[:12]} differs from the sent "
                              f"{(sent or '')[:12]}")


class Transport(ABC):
    """One way weights move (see the module docstring). Subclasses set ``name`` (the registry
    key), ``device`` and ``upstream`` (what the docs' table says of them) and implement
    ``receive``; the sender-side steps a transport does not need are no-ops.

    Args:
        timeout_s: the limit of a transaction (seconds): what a wait on a participant from outside
            allows; each of a participant's own waits gets ``own_wait_s``.
    """

    name: ClassVar[str]
    device: ClassVar[str]
    upstream: ClassVar[str]

    def __init__(self, *, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s

    @property
    def own_wait_s(self) -> float:
        """The limit of each of a participant's own waits (``OWN_WAIT_SHARE`` of ``timeout_s``, seconds)."""
        return self.timeout_s * OWN_WAIT_SHARE

    def prepare(self, tensors: Mapping[str, torch.Tensor], plan: SyncPlan, *, device: torch.device | str) -> dict:
        """Sender side, before the transfer: what the receiver needs to take the weights (none
        by default)."""
        return {}

    def send(self, tensors: Mapping[str, torch.Tensor], plan: SyncPlan, **meet: Any) -> SyncReport:
        """Sender side: move ``tensors`` (packed by ``plan``) to the receivers.

        Raises:
            NotImplementedError: a transport whose receiver takes the weights itself.
        """
        raise NotImplementedError(f"the {self.name} transport has no separate send: its receiver takes the weights")

    @abstractmethod
    def receive(self, into: Any, plan: SyncPlan, sender: Sender, *, what: str, **meet: Any) -> Any:
        """Receiver side: land the weights in ``into`` (tensors or an engine), verified against
        the sender's checksum; ``what`` names the transaction in errors.

        Raises:
            WeightSyncError: the transfer failed, timed out or its checksums differ (``into`` is
                then invalid until a sync lands).
        """

    def finalize(self) -> None:
        """Sender side, after the receiver has the weights: free what ``prepare`` kept."""


TRANSPORTS: dict[str, type[Transport]] = {}


def register(cls: type[Transport]) -> type[Transport]:
    """Class decorator: register a transport under its ``name``."""
    TRANSPORTS[cls.name] = cls
    return cls
