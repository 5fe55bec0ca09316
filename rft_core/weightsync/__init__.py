"""Weight sync: how the trainer's weights reach an inference copy (a resident worker's model, a
vLLM or SGLang engine) without touching storage. A library below the engines and the workers:
it imports neither (docs/architecture.md, "Weight sync", tables its transports).

- ``session``: the transaction, once (``pull``: prepare, choose, send ‖ receive, verify,
  finalize; the only caller of ``choose_transport``), and the sender's leg it drives (``SendLeg``);
- ``base``: the interface every transport has (``Transport``: ``send(tensors, plan, meet)``,
  ``receive(plan, meet, landing)``, ``finalize``), the ``Meet`` and the registry;
- ``landing``: where the bytes land (``IntoTensors``: a model's tensors; ``IntoEngine``: an
  engine's loader);
- ``choose``: ``choose_transport`` and ``transport`` (a registered backend by name);
- ``plan``: the plan, buckets and reports every transport shares; ``digest``: the one weight
  digest (XXH3-128 on the host, exact device sums on a GPU: ``checksum``, sha256 read back);
- the backends: ``local`` (one process), ``shm`` (two processes on one host's CPU),
  ``collective`` (gloo, NCCL), ``cuda_ipc`` (one GPU, two processes), ``engine`` (into vLLM's
  workers, into SGLang);
- ``trained``: what a trainer sends (LoRA merged or its adapters alone, ZeRO and FSDP2 gathered)
  and the digest commits record.
"""
