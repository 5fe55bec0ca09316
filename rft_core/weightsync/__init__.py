"""Weight sync: how the trainer's weights reach an inference copy (a resident worker's model, a
vLLM or SGLang engine) without touching storage. A library below the engines and the workers:
it imports neither (docs/architecture.md, "Weight sync", tables its transports).

- ``base``: the interface (``Transport``: prepare, send, receive, finalize) and the registry;
- ``choose``: ``choose_transport`` (the one place a transport is picked from the two ends) and
  ``transport`` (a registered backend by name);
- ``plan``: the plan, buckets, reports and digests every transport shares; ``checksum``: the
  exact on-device checksum;
- the backends: ``local`` (one process), ``collective`` (gloo, NCCL), ``cuda_ipc`` (one GPU, two
  processes), ``engine`` (into vLLM's workers, into SGLang);
- ``trained``: what a trainer sends (LoRA merged, ZeRO gathered) and the digest commits record.
"""
