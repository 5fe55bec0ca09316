"""The Ray runtime of the resident workers: ``base`` (what every worker shares, and the fan-out
of a call across a gang's ranks, declared per method), one worker class per role (``policy``:
the trainer and sender of weight syncs, with the exact rebuild; ``rollout``: the rollout engine,
the receiver, GPU engines included; ``reference``; ``critic``) and ``pool`` (the Ray actors,
the class of each role). Above the stages: it imports them, they never import it
(docs/architecture.md)."""
