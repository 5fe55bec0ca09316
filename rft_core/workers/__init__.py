"""The Ray runtime of the resident workers: ``resident`` (one worker per role), ``pool`` (the Ray
actors), ``engine_sync`` (a rollout engine's side of a weight sync), ``rebuild`` (exact recovery).
Above the stages: it imports them, they never import it (docs/architecture.md)."""
