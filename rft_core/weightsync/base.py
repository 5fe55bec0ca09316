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
        """Give up on a started send (the receiver failed first)."""

    def export(self) -> dict[str, Any]:
        """The sender's ``prepare`` answer of a CUDA IPC transaction (``handles``, ``digest``)."""

    def release(self) -> None:
        """The sender's ``finalize`` (CUDA IPC: free the exported buffers)."""


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
        timeout_s: the limit of each collective of a transaction (seconds).
    """

    name: ClassVar[str]
    device: ClassVar[str]
    upstream: ClassVar[str]

    def __init__(self, *, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s

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
