"""The weight-sync transaction, once: ``pull`` makes a landing (a model's tensors, an engine)
hold the sender's version of the weights, whatever moves them.

1. **Prepare.** The sender's leg ``offer``s the version (``Offer``: where it meets, its device,
   backend and host, and for an engine its plan in the engine's dtype), or answers None: it does
   not hold the version and the version is on storage (the caller loads it from there).
2. **Choose.** The landing gives the plan (its own, or the offered one) and ``choose_transport``
   (this module is its only caller) picks the transport from the two ends; the ``Meet`` records
   the choice. The landing is invalid from here until step 4 passes.
3. **Send ‖ receive.** A collective transport (no handoff) runs both legs together: the sender's
   ``send`` started, the receiver's ``receive`` here; a receive that fails awaits the sender
   (``settle``: one stuck past its limit is ended). A handoff transport (``local``, ``shm``,
   ``cuda_ipc``) awaits the send first and receives from what it left (``Meet.handoff``).
4. **Verify.** The landed digest must equal the sent one (``verify_digest``); otherwise the
   landing stays invalid and ``WeightSyncError`` is raised: ``pull`` never returns weights it
   has not verified.
5. **Finalize.** The sender frees what its send kept (``SendLeg.finish``: CUDA IPC buffers).

One ``SyncReport`` comes back (bytes, seconds of the whole transaction, buckets, the verified
digest, the backend that moved the bytes), and the sync is counted (``weight_syncs``,
``weight_sync_seconds``, ``weight_sync_bytes``); its ``extra`` has the ``transport`` and each
leg's own seconds (``send_s``, ``receive_s``).

The sender's leg (``SendLeg``) is the policy gang's, as ``rft_core.workers.policy.PolicySendLeg``
drives it (Ray actors, or the worker object itself in one process); tests hand their own.
Modelled on verl's ``CheckpointEngineManager.update_weights`` (prepare, build the topology, send
and receive, finalize), with this project's plan fingerprint, per-rank failure flags, exact
digests and bounded waits.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from rft_core.counters import count
from rft_core.models.lora import keeps_adapters
from rft_core.weightsync.base import Meet, Transport, verify_digest
from rft_core.weightsync.choose import choose_transport, transport
from rft_core.weightsync.landing import Landing
from rft_core.weightsync.plan import SyncPlan, SyncReport, WeightSyncError
from rft_core.weightsync.shm import segment_layout

log = logging.getLogger("rft_core.weightsync")


@dataclass(frozen=True)
class Offer:
    """The sender's answer to ``SendLeg.offer``: it holds the version and sends it.

    Args:
        backend: its collective backend (``group_backend`` of its device).
        device: its ``device_id`` ("cpu" or the GPU's UUID).
        host: its ``shm.host_id``.
        addr, port: where it hosts a collective's rendezvous.
        shm_free: bytes its ``/dev/shm`` has for a segment (``Shm.capacity``; 0 from a GPU).
        plan: its plan in the dtype asked for (``SyncPlan.to_json``), when one was asked for.
        lora: its policy is a peft LoRA model (it can send its adapters: ``Meet.adapters``).
    """

    backend: str
    device: str
    host: str
    addr: str
    port: int
    shm_free: int = 0
    plan: str | None = None
    lora: bool = False


class SendLeg(Protocol):
    """The receiver's handle on the sending side of one transaction (the policy trainer's ranks,
    bound to the version synced)."""

    @property
    def local(self) -> bool:
        """Whether the sender runs in this process."""

    def offer(self, dtype: str | None) -> Offer | None:
        """``Offer`` of the version (with its plan in ``dtype`` when given), or None: not held
        and on storage."""

    def start(self, meet: Meet) -> Any:
        """Start the sender's ``send`` on every rank; returns what ``wait`` and ``cancel`` take."""

    def wait(self, started: Any) -> SyncReport:
        """Rank 0's report of a started send; raises what it raised (``TimeoutError`` past its limit)."""

    def cancel(self, started: Any) -> None:
        """End a started send that outlived its limit."""

    def finish(self, meet: Meet) -> None:
        """The sender's ``finalize`` of the transport of ``meet``."""


def settle(leg: SendLeg, started: Any) -> str:
    """After the receiver's side of a transaction failed: wait for the sender's started send
    (``leg.wait``, bounded by the sender's own limit, ``sync_timeout_s``: its collectives fail on
    their own within it once the receiver is gone), so that it is not left running into the
    sender's next call. A send whose wait times out (``TimeoutError``; Ray's ``GetTimeoutError``
    is one) is stuck past every limit of the transaction (in NCCL's communicator setup, which no
    timeout covers): it is cancelled (``leg.cancel``; the policy gang's ends its ranks, since Ray
    cannot interrupt a running call). Returns what became of the send, for the receiver's error
    message; raises nothing."""
    try:
        leg.wait(started)
        return "the sender finished its send"
    except TimeoutError as exc:
        leg.cancel(started)
        return f"the sender was still sending past its limit and was ended ({exc})"
    except Exception as exc:  # noqa: BLE001  expected: the sender failed too; the receiver's error is the one raised
        return f"the sender failed too: {type(exc).__name__}: {exc}"


def _in_flight(link: Transport, leg: SendLeg, plan: SyncPlan, meet: Meet, landing: Landing,
               what: str) -> tuple[SyncReport, SyncReport]:
    """Both legs together (a broadcast): (landed report, sent report)."""
    started = leg.start(meet)
    try:
        got = link.receive(plan, meet, landing)
    except WeightSyncError as exc:
        raise WeightSyncError(f"{exc}; {settle(leg, started)}") from exc
    try:
        return got, leg.wait(started)
    except Exception as exc:  # noqa: BLE001  the sender failed after the receiver finished
        raise WeightSyncError(f"{what}: the policy worker failed: {exc}") from exc


def _handoff(link: Transport, leg: SendLeg, plan: SyncPlan, meet: Meet, landing: Landing,
             what: str) -> tuple[SyncReport, SyncReport]:
    """The send first, then the receive from what it left; the sender's ``finish`` after both."""
    started = leg.start(meet)
    try:
        sent = leg.wait(started)
    except TimeoutError as exc:
        leg.cancel(started)
        raise WeightSyncError(f"{what}: the policy worker did not hand its weights over within its limit and was "
                              f"ended ({exc})") from exc
    except Exception as exc:  # noqa: BLE001  its send failed (the plan does not fit, no room in /dev/shm, ...)
        raise WeightSyncError(f"{what}: the policy worker failed: {exc}") from exc
    try:
        got = link.receive(plan, dataclasses.replace(meet, handoff=sent.extra.get("handoff")), landing)
    finally:
        leg.finish(meet)
    return got, sent


def check_adapters(offer: Offer, landing: Landing, what: str) -> None:
    """Refuse, before anything moves, a sync whose two ends disagree on a LoRA policy's adapters:
    a landing that asks for adapters from a sender without them, and an HF copy below float32
    that would take a LoRA policy's merged weights where stage mode's passes keep the adapters
    (``rft_core.models.lora.keeps_adapters``: its rollouts would differ from stage mode's; the
    rollout worker is given the run's ``update.lora`` by ``WorkersConfig.lora``), and an engine
    (vLLM, SGLang) that would take them merged in any dtype, where stage mode's engine serves the
    adapter checkpoint unmerged (``LoRARequest``, ``load_lora_adapter``): a LoRA run's rollout
    worker lands the adapters for its engine instead (``RolloutWorker._engine_adapters``).

    Raises:
        WeightSyncError: as above.
    """
    if landing.adapters and not offer.lora:
        raise WeightSyncError(f"{what}: the receiving copy keeps LoRA adapters but the policy worker holds a policy "
                              "without them (update.lora differs between the two)")
    if not offer.lora or landing.adapters:
        return
    if landing.engine_kind is not None:
        raise WeightSyncError(f"{what}: the policy is a LoRA model and the {landing.engine_kind} engine would take its "
                              "merged weights, where stage mode's engine serves the adapter on the base; the rollout "
                              "worker was not given the run's update.lora (WorkersConfig.lora), which has it land the "
                              "adapters for its engine")
    if keeps_adapters(landing.dtype):
        raise WeightSyncError(f"{what}: the policy is a LoRA model and the receiving copy is {landing.dtype}, below "
                              "float32, where it keeps the float32 adapters on its base as the trainer computes; it "
                              "was not given the run's update.lora (RolloutWorker(lora=...), WorkersConfig.lora), so "
                              "it would take the merged weights and sample from another policy than stage mode's")


def pull(leg: SendLeg, landing: Landing, *, version: str, timeout_s: float, bucket_mb: float) -> SyncReport | None:
    """Make ``landing`` hold the sender's ``version`` by a verified transaction (the module docstring).

    Args:
        leg: the sender's leg, bound to the version.
        landing: where the weights land (``IntoTensors``, ``IntoEngine``).
        version: what the weights are (the receiver's key; an engine records it).
        timeout_s: the transaction's limit (``orchestration.sync_timeout_s``): each of the
            receiver's own waits gets ``OWN_WAIT_SHARE`` of it, an engine's receive all of it.
        bucket_mb: the bucket limit (``orchestration.sync_bucket_mb``).
    Returns:
        the verified ``SyncReport`` (``seconds``: the whole transaction, the offer included;
        ``backend``: what moved the bytes, an engine's collective backend for an engine), or None
        when the sender does not hold ``version`` and it is on storage (nothing moved).
    Raises:
        ValueError: a LoRA engine (``IntoEngine``, before anything starts).
        WeightSyncError: the two ends disagree on a LoRA policy's adapters (``check_adapters``,
            before anything moves), the transfer failed or timed out, a side refused the other's layout, the
            sender failed, or the digests differ; the landing is then invalid.
        Whatever ``leg.offer`` raises (the sender's gang is not running: ``WorkerError``).
    """
    t0 = time.perf_counter()
    what = f"weight sync of {version}{landing.what}"
    offer = leg.offer(landing.offer_dtype)
    if offer is None:
        return None
    check_adapters(offer, landing, what)
    plan = landing.plan(offer.plan, bucket_mb)
    name = choose_transport(backend=offer.backend, sender_device=offer.device, receiver_device=landing.device,
                            same_process=leg.local, engine=landing.engine_kind, sender_host=offer.host,
                            shm_free=offer.shm_free, nbytes=segment_layout(plan)[1])
    link = transport(name, timeout_s=timeout_s)
    meet = Meet(transport=name, dtype=landing.dtype, version=version, backend=offer.backend, addr=offer.addr,
                port=offer.port, world_size=landing.world_size, adapters=landing.adapters)
    link.check(landing, what)
    landing.invalidate()
    try:
        got, sent = (_handoff if link.handoff else _in_flight)(link, leg, plan, meet, landing, what)
        verify_digest(got.digest, sent.digest if sent is not None else None, what)
    except BaseException:
        landing.invalidate()
        raise
    report = SyncReport(bytes=got.bytes, seconds=time.perf_counter() - t0, buckets=got.buckets, digest=got.digest,
                        backend=offer.backend if landing.engine_kind else name,
                        extra={"transport": name, "send_s": sent.seconds, "receive_s": got.seconds})
    count("weight_syncs")
    count("weight_sync_seconds", report.seconds)
    count("weight_sync_bytes", report.bytes)
    log.info("%s (%s): %.1f MB in %.3f s (%.2f s/GB), digest verified", what, name, report.bytes / 1e6,
             report.seconds, report.seconds / max(report.bytes / 1e9, 1e-12))
    return report
