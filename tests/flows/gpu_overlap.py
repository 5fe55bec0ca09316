"""Two `gpu`-tagged tasks submitted together, each holding for a while; prints their wall-clock
(start, end) intervals as one JSON line prefixed ``INTERVALS``. Run against a server
(``PREFECT_API_URL``) by tests/flows/test_deployment.py to see the `gpu` tag concurrency limit
serialise them."""
from __future__ import annotations

import json
import sys
import time

from prefect import flow, task


@task(tags=["gpu"])
def hold(seconds: float) -> tuple[float, float]:
    """Occupy a `gpu` slot for ``seconds``; returns (start, end) in epoch seconds."""
    t0 = time.time()
    time.sleep(seconds)
    return t0, time.time()


@flow(name="gpu-overlap")
def two_gpu_tasks(seconds: float = 1.5) -> list[tuple[float, float]]:
    """Submit two `hold` tasks at once (thread pool task runner) and return their intervals."""
    futures = [hold.submit(seconds) for _ in range(2)]
    return [f.result() for f in futures]


if __name__ == "__main__":
    print("INTERVALS " + json.dumps(two_gpu_tasks(float(sys.argv[1]) if len(sys.argv) > 1 else 1.5)), flush=True)
