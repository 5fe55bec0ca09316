"""Write small arithmetic datasets ("What is 37 + 45?") in the formats users bring.

    .venv/bin/python examples/make_datasets.py            # -> examples/data/
    .venv/bin/python examples/make_datasets.py --out /tmp/d --rows 500 --seed 3

Files (the same ``--rows`` training questions in each, seeded; answers computed exactly):

| file | format | layout |
|---|---|---|
| ``arith_verl.parquet`` | Parquet | verl: ``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model.ground_truth``, ``extra_info`` |
| ``arith_trl.jsonl`` | JSON Lines | TRL conversational: ``prompt`` (system + user messages), ``solution`` |
| ``arith.csv`` | CSV | plain: ``question``, ``answer`` |
| ``arith_test.jsonl`` | JSON Lines | TRL conversational, ``--test-rows`` held-out questions that occur in no training file |
"""
from __future__ import annotations

import argparse
import csv
import json
import random
from pathlib import Path

SYSTEM_PROMPT = "You are a helpful assistant. Solve the problem. Give the final answer on the last line as: Answer: <answer>"
DATA_SOURCE = "arithmetic"
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_questions(n: int, *, seed: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    """``n`` distinct (question, answer) pairs "What is a op b?" with a, b in 1..99 (b in 1..12
    for ``*``), op in + - *, drawn with ``random.Random(seed)``; questions in ``exclude`` are skipped.

    Raises:
        ValueError: ``n`` larger than the distinct questions available.
    """
    if n > 2 * 99 * 99 + 99 * 12 - len(exclude):
        raise ValueError(f"cannot make {n} distinct questions")
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < n:
        op = rng.choice(sorted(_OPS))
        a, b = rng.randint(1, 99), rng.randint(1, 12 if op == "*" else 99)
        q = f"What is {a} {op} {b}?"
        if q not in seen:
            seen.add(q)
            out.append((q, str(_OPS[op](a, b))))
    return out


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def write_verl_parquet(rows: list[tuple[str, str]], path: Path, *, split: str = "train") -> None:
    """verl's RL Parquet layout (``examples/data_preprocess/gsm8k.py`` in volcengine/verl)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([
        {"data_source": DATA_SOURCE, "prompt": _messages(q), "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"split": split, "index": i, "question": q}}
        for i, (q, a) in enumerate(rows)])
    pq.write_table(table, path)


def write_trl_jsonl(rows: list[tuple[str, str]], path: Path) -> None:
    """TRL's conversational prompt-only layout: ``prompt`` messages, plus a ``solution`` column
    that GRPOTrainer passes to reward functions."""
    with open(path, "w", encoding="utf-8") as f:
        for q, a in rows:
            f.write(json.dumps({"prompt": _messages(q), "solution": a}) + "\n")


def write_plain_csv(rows: list[tuple[str, str]], path: Path) -> None:
    """``question,answer`` with a header row."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["question", "answer"])
        w.writerows(rows)


def write_all(out: str | Path, *, rows: int = 200, test_rows: int = 50, seed: int = 0) -> dict[str, Path]:
    """Write the four files into ``out`` (created) and return {name: path}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train = make_questions(rows, seed=seed)
    test = make_questions(test_rows, seed=seed + 1, exclude={q for q, _ in train})
    paths = {"verl": out / "arith_verl.parquet", "trl": out / "arith_trl.jsonl", "csv": out / "arith.csv",
             "test": out / "arith_test.jsonl"}
    write_verl_parquet(train, paths["verl"])
    write_trl_jsonl(train, paths["trl"])
    write_plain_csv(train, paths["csv"])
    write_trl_jsonl(test, paths["test"])
    return paths


def main() -> None:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--test-rows", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name, path in write_all(args.out, rows=args.rows, test_rows=args.test_rows, seed=args.seed).items():
        print(f"{name:5s} {path}")


if __name__ == "__main__":
    main()
