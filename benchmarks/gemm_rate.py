"""This machine's sustained float32 matrix-multiply rate: the physical limit ``vs_trl.py`` compares
a GRPO step's arithmetic against (issue 19).

Square ``n x n`` float32 ``torch.matmul`` into a preallocated output, ``2 * n**3`` floating-point
operations each (n multiplies and n adds per output element; the FMA counts as two). After a
warm-up, ``rounds`` rounds each repeat the product for ``seconds / rounds`` seconds; a round's rate
is its products' FLOPs over its wall time. The median round is the sustained rate, the best round
the ceiling. With 2048 x 2048 (16 MiB per matrix, 17.2 GFLOP per product) the product is large
enough that the BLAS kernel, not the call overhead or the memory, sets the rate.

    .venv/bin/python benchmarks/gemm_rate.py                 # ~10 s, torch's default threads
    .venv/bin/python benchmarks/gemm_rate.py --threads 1 --n 1024 --seconds 4
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def gemm_flops(n: int) -> int:
    """Floating-point operations of one ``n x n`` by ``n x n`` matrix product: ``2 * n**3``
    (a multiply and an add per inner-product term)."""
    return 2 * n**3


def sustained_gemm_gflops(threads: int | None = None, n: int = 2048, seconds: float = 8.0, rounds: int = 4,
                          warmup_seconds: float = 1.0, seed: int = 0) -> dict:
    """Measure the sustained float32 ``torch.matmul`` rate of square ``n x n`` products on CPU.

    Args:
        threads: torch intra-op threads during the measurement (None: torch's current setting,
            the same as a fresh process of the benchmark gets); restored afterwards.
        n: matrix side (elements); each product is ``2 * n**3`` FLOPs.
        seconds: total measuring time in seconds, split evenly over ``rounds`` (the warm-up
            comes on top).
        rounds: measured rounds; each round repeats the product until its share of
            ``seconds`` has elapsed (at least one product).
        warmup_seconds: seconds of unmeasured products first (thread pool start-up, page faults,
            CPU frequency ramp); at least one product.
        seed: seed of the random inputs.

    Returns:
        A JSON-ready dict: ``gflops_median`` (GFLOP/s, the median round: the sustained rate),
        ``gflops_best`` (GFLOP/s, the fastest round), ``gflops_rounds`` (GFLOP/s per round),
        ``products`` (products per round), ``n``, ``threads``, ``seconds`` (wall seconds of the
        whole measurement, warm-up included), ``dtype`` and ``torch`` (version).
    """
    import torch

    if n < 1 or rounds < 1 or seconds <= 0:
        raise ValueError(f"n ({n}), rounds ({rounds}) and seconds ({seconds}) must be positive")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(n, n, generator=gen, dtype=torch.float32)
        b = torch.randn(n, n, generator=gen, dtype=torch.float32)
        out = torch.empty(n, n, dtype=torch.float32)
        flops = gemm_flops(n)
        t_start = time.perf_counter()
        with torch.inference_mode():
            _repeat_matmul(a, b, out, warmup_seconds)
            per_round = seconds / rounds
            rates, products = [], []
            for _ in range(rounds):
                count, elapsed = _repeat_matmul(a, b, out, per_round)
                rates.append(count * flops / elapsed / 1e9)
                products.append(count)
        return {"gflops_median": statistics.median(rates), "gflops_best": max(rates), "gflops_rounds": rates,
                "products": products, "n": n, "threads": torch.get_num_threads(),
                "seconds": time.perf_counter() - t_start, "dtype": "float32", "torch": torch.__version__}
    finally:
        torch.set_num_threads(previous)


def _repeat_matmul(a, b, out, seconds: float) -> tuple[int, float]:
    """``torch.matmul(a, b, out=out)`` repeated until ``seconds`` of wall time have passed (at
    least once); returns (products, elapsed wall seconds)."""
    import torch

    count = 0
    t0 = time.perf_counter()
    while True:
        torch.matmul(a, b, out=out)
        count += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return count, elapsed


def main() -> None:
    """CLI: measure and print the result of ``sustained_gemm_gflops`` as JSON on stdout."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--n", type=int, default=2048, help="matrix side (default 2048)")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds, all rounds (default 8; +1 s warm-up)")
    ap.add_argument("--rounds", type=int, default=4, help="measured rounds (default 4)")
    args = ap.parse_args()
    print(json.dumps(sustained_gemm_gflops(args.threads, n=args.n, seconds=args.seconds, rounds=args.rounds)))


if __name__ == "__main__":
    main()
