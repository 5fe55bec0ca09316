"""The in-process transport (``local``): both ends in one process (tests, the no-Ray driver), a
handoff of the sender's tensors themselves: the receiver copies each into its own tensor (cast
to its dtype) and digests what landed; the sender digests its tensors as cast to the plan."""
from __future__ import annotations

import time
from typing import Mapping

import torch

from rft_core.weightsync.base import Meet, Transport, handoff_of, refuse_other_layout, register
from rft_core.weightsync.digest import Digest, sync_method
from rft_core.weightsync.landing import IntoTensors, Landing
from rft_core.weightsync.plan import SyncPlan, SyncReport, check_fits


@register
class LocalCopy(Transport):
    """Both ends in one process: the send hands over its tensors (``extra["handoff"]["tensors"]``),
    the receiver copies them into its landing."""

    name = "local"
    device = "the receiver's tensors' device"
    upstream = "torch (Tensor.copy_)"
    handoff = True

    def send(self, tensors: Mapping[str, torch.Tensor], plan: SyncPlan, meet: Meet) -> SyncReport:
        """Digest ``tensors`` as cast to the plan's dtypes and hand them over (no copy).

        Raises:
            WeightSyncError: the tensors do not fit the plan.
        """
        check_fits(plan, tensors)
        t0 = time.perf_counter()
        digest = Digest(plan.layout(), sync_method(self.name))
        for e in plan.entries:
            digest.add(e.name, tensors[e.name].detach().to(dtype=e.torch_dtype))
        sent = digest.hexdigest()
        return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                          digest=sent, backend=self.name,
                          extra={"handoff": handoff_of(plan, tensors=tensors)})

    def receive(self, plan: SyncPlan, meet: Meet, landing: Landing) -> SyncReport:
        """Copy the handed-over tensors into the landing, tensor by tensor (``IntoTensors.put``).

        Raises:
            TypeError: a landing that is not a model's tensors.
            WeightSyncError: the layouts differ, or the landing does not fit the plan.
        """
        if not isinstance(landing, IntoTensors):
            raise TypeError(f"the local transport lands in a model's tensors, not in {type(landing).__name__}")
        refuse_other_layout(plan, meet.handoff, buckets=False)  # tensor by tensor: buckets play no part
        check_fits(plan, landing.target)
        t0 = time.perf_counter()
        tensors = meet.handoff["tensors"]
        digest = Digest(plan.layout(), sync_method(self.name))
        for e in plan.entries:
            landing.put(e.name, tensors[e.name], digest)
        landed = digest.hexdigest()  # every piece copied and hashed
        return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                          digest=landed, backend=self.name)
