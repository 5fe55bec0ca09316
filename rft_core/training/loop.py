"""The one training loop of the policy and the critic: epochs -> mini-batches (one optimizer
step each) -> micro-batches (one forward/backward each) -> the strategy (single process or
DeepSpeed ranks) -> the device.

Gradient accumulation is exact: the caller's micro-batch loss is normalised by the totals of its
whole mini-batch (``Normaliser``), so the accumulated gradient equals the gradient of the
mini-batch loss computed in one piece. Under DeepSpeed the micro-batches of each mini-batch are
dealt out round-robin over the ranks, every rank runs as many passes (zero-weight repeats, since
ZeRO 2/3 communicate inside backward), and the statistics are summed over ranks.

Precision: the loop runs inside ``strategy.training()`` and each micro-batch's forward and loss
inside ``strategy.autocast()``; backward runs outside autocast, as PyTorch's AMP recipe
prescribes. In mixed precision (``rft_core.training.strategy.MasterWeights``) neither switches
anything: forward and backward run on the bfloat16 parameters, the weights the log-prob passes
use, each backward's bfloat16 gradients are added into float32 master gradients as they arrive,
and ``strategy.step()`` updates the float32 masters and rounds them into the parameters.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Protocol, Sequence

import torch


class Strategy(Protocol):
    """What the loop needs of a training strategy (``rft_core.training.strategy``)."""

    rank: int
    world_size: int
    model: torch.nn.Module

    def training(self) -> ContextManager[None]: ...
    def autocast(self) -> ContextManager[Any]: ...
    def zero_grad(self) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> float: ...
    def all_reduce_sum(self, values: list[float]) -> list[float]: ...
    @property
    def lr(self) -> float: ...


@dataclass(frozen=True)
class Normaliser:
    """Totals of one mini-batch, handed to every loss aggregation of its micro-batches
    (``rft_core.algorithms.aggregation.LOSS_AGGREGATIONS`` keywords).

    num_tokens: response tokens that count; num_sequences: samples; norm_tokens: the constant
    token budget of ``seq-mean-token-sum-norm``.
    """

    num_tokens: int
    num_sequences: int
    norm_tokens: int

    def as_kwargs(self) -> dict[str, int]:
        """The aggregation keywords."""
        return {"num_tokens": self.num_tokens, "num_sequences": self.num_sequences, "norm_tokens": self.norm_tokens}


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: its epoch, the statistics summed over its micro-batches (and ranks),
    the gradient norm before clipping, the learning rate and the mini-batch's normaliser."""

    step: int
    epoch: int
    sums: dict[str, float]
    grad_norm: float
    lr: float
    norm: Normaliser


# one micro-batch: (sample indices, normaliser) -> (loss to backpropagate, statistics to sum)
MicroStep = Callable[[list[int], Normaliser], tuple[torch.Tensor, dict[str, float]]]


def check_per_token_lists(owner: str, data: object, names: Sequence[str]) -> None:
    """Check that ``data.responses`` has one entry per prompt and every per-token field of
    ``data`` named in ``names`` (None: absent) one list per sample, as long as its response.

    Raises:
        ValueError: naming ``owner``, the field and the first sample whose list has another length.
    """
    prompts, responses = getattr(data, "prompts"), getattr(data, "responses")
    n = len(prompts)
    if len(responses) != n:
        raise ValueError(f"{owner}: {len(responses)} responses for {n} prompts")
    for name in names:
        values = getattr(data, name)
        if values is None:
            continue
        if len(values) != n:
            raise ValueError(f"{owner}: {name} has {len(values)} entries for {n} samples")
        for i, (v, r) in enumerate(zip(values, responses)):
            if len(v) != len(r):
                raise ValueError(f"{owner}: sample {i} has {len(r)} response tokens but {len(v)} {name} entries")


def pad_float(rows: Sequence[Sequence[float]], T: int) -> torch.Tensor:
    """(len(rows), T) float32, each row right-padded with zeros."""
    out = torch.zeros(len(rows), T, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def minibatches(n: int, *, epochs: int, batch_size: int, seed: int) -> Iterator[tuple[int, list[int]]]:
    """Yield (epoch, sample indices of one optimizer step): each epoch a fresh permutation
    (torch.Generator seeded with ``seed``, independent of the global RNG), cut into batches."""
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for start in range(0, n, batch_size):
            yield epoch, order[start:start + batch_size]


@dataclass(frozen=True)
class MicroBatching:
    """How the loop cuts a mini-batch (sample indices, in its shuffled order) into micro-batches.

    ``size``: consecutive chunks of ``size`` samples (the last may be shorter). ``max_tokens``
    (not None): by tokens instead (``token_budget_micro_batches`` over ``lengths``, each
    sample's prompt + response tokens: what its packed row holds), ``size`` unused; ``key``: the
    budget's config key, named in its error.

    Raises:
        ValueError: ``size`` < 1, ``max_tokens`` < 1, or ``max_tokens`` without ``lengths``.
    """

    size: int
    max_tokens: int | None = None
    lengths: Sequence[int] | None = None
    key: str = "max_tokens_per_micro_batch"

    def __post_init__(self) -> None:
        if self.size < 1 or (self.max_tokens is not None and self.max_tokens < 1):
            raise ValueError(f"MicroBatching: size {self.size} and max_tokens {self.max_tokens} must be >= 1")
        if self.max_tokens is not None and self.lengths is None:
            raise ValueError("MicroBatching: max_tokens needs the samples' lengths")

    @classmethod
    def of(cls, section: str, cfg: Any, prompts: Sequence[Sequence[int]],
           responses: Sequence[Sequence[int]]) -> "MicroBatching":
        """The cut of config section ``section`` ("update" or "critic"; ``cfg`` has its
        ``micro_batch_size`` and ``max_tokens_per_micro_batch``: the section itself or an
        ``UpdateGrouping``) over these samples; their lengths are counted only for a budget."""
        budget = cfg.max_tokens_per_micro_batch
        return cls(cfg.micro_batch_size, budget, None if budget is None else packed_lengths(prompts, responses),
                   f"{section}.max_tokens_per_micro_batch")

    def cut(self, mini: Sequence[int]) -> list[list[int]]:
        """The micro-batches of ``mini``: every index in exactly one, each in ``mini``'s order.

        Raises:
            ValueError: by tokens, a sample longer than ``max_tokens`` (``key`` named).
        """
        if self.max_tokens is None or self.lengths is None:
            return [list(mini[i:i + self.size]) for i in range(0, len(mini), self.size)]
        return token_budget_micro_batches(mini, self.lengths, self.max_tokens, key=self.key)


def token_budget_micro_batches(mini: Sequence[int], lengths: Sequence[int], max_tokens: int, *,
                               key: str = "max_tokens_per_micro_batch") -> list[list[int]]:
    """Cut ``mini`` (sample indices) into micro-batches of at most ``max_tokens`` tokens each,
    balanced by tokens: k = ceil(total / max_tokens) micro-batches, the samples dealt longest
    first (ties: earlier in ``mini`` first) each to the micro-batch with the fewest tokens so far
    (ties: the lower index), the LPT rule (Graham 1969, "Bounds on multiprocessing timing
    anomalies"), and k + 1 while one of them exceeds ``max_tokens`` (k = len(mini) gives one sample
    each, so it ends). LPT balances but is not a bin packing: on 300 random mini-batches of 1-40
    samples it needed at most 2 micro-batches more than first-fit decreasing, and once one fewer
    (tests/rft_core/training/test_token_budget.py). Each micro-batch keeps ``mini``'s order; they
    are ordered by their first sample's place in ``mini``. Deterministic: a function of
    ``mini``'s order and the lengths.

    verl's dynamic batch size (``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``,
    verl/utils/seqlen_balancing.py ``rearrange_micro_batches``) partitions into ceil(total /
    max_token_len) by Karmarkar-Karp without checking the result against the budget; here no
    micro-batch exceeds it.

    Args:
        lengths: tokens of each sample (indexed by the values of ``mini``), each >= 1.
        key: the config key of ``max_tokens``, named in the error.
    Raises:
        ValueError: a sample of more than ``max_tokens`` tokens (its index, its length and ``key``
            named).
    """
    too_long = [i for i in mini if lengths[i] > max_tokens]
    if too_long:
        i = too_long[0]
        raise ValueError(f"sample {i} has {lengths[i]} tokens (prompt and response), more than {key}={max_tokens} "
                         f"({len(too_long)} such samples): a micro-batch holds whole samples; raise {key} to at least "
                         "the longest prompt + response")
    if not mini:
        return []
    place = {i: p for p, i in enumerate(mini)}
    longest_first = sorted(mini, key=lambda i: (-lengths[i], place[i]))
    k = max(1, -(-sum(lengths[i] for i in mini) // max_tokens))
    while True:
        heap = [(0, b) for b in range(k)]  # (tokens so far, micro-batch): a heap ordered by both
        bins: list[list[int]] = [[] for _ in range(k)]
        for i in longest_first:
            tokens, b = heapq.heappop(heap)
            bins[b].append(i)
            heapq.heappush(heap, (tokens + lengths[i], b))
        if max(tokens for tokens, _ in heap) <= max_tokens:
            break
        k += 1
    return sorted((sorted(b, key=place.__getitem__) for b in bins if b), key=lambda b: place[b[0]])


def packed_lengths(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[int]:
    """Each sample's tokens in a packed row: len(prompt) + len(response) (``MicroBatching.lengths``)."""
    return [len(p) + len(r) for p, r in zip(prompts, responses)]


def pass_micro_batches(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], max_tokens: int, *,
                       key: str) -> list[list[int]]:
    """The packed rows of a log-prob or value pass over these samples with a token budget
    (``logprobs.max_tokens_per_micro_batch``, ``critic.max_tokens_per_micro_batch``):
    ``token_budget_micro_batches`` of all samples in index order over their ``packed_lengths``
    (``key``: the budget's config key).

    Raises:
        ValueError: a sample longer than ``max_tokens``.
    """
    return token_budget_micro_batches(range(len(prompts)), packed_lengths(prompts, responses), max_tokens, key=key)


def epoch_micro_batches(n: int, *, train_batch_size: int | None, micro_batching: MicroBatching,
                        seed: int) -> list[list[int]]:
    """The micro-batches (sample indices, in order) of the first epoch of ``train_steps`` over
    ``n`` samples: ``minibatches``' seeded permutation cut into optimizer steps of
    ``train_batch_size`` (None: all) and those by ``micro_batching``, as ``train_steps`` cuts them
    (on every rank the same). Every sample is in exactly one. The log-prob passes use them below
    float32 (``TrainConfig.logprob_grouping_at``); none for ``n`` = 0 (a partial rollout's
    iteration in which no group finished)."""
    if n == 0:
        return []
    return [chunk for _, mini in minibatches(n, epochs=1, batch_size=train_batch_size or n, seed=seed)
            for chunk in micro_batching.cut(mini)]


def rank_micro_batches(chunks: list[list[int]], *, rank: int, world_size: int) -> list[tuple[list[int], float]]:
    """This rank's micro-batches of a mini-batch's ``chunks`` (``MicroBatching.cut``) with weight
    1, round-robin, plus zero-weight repeats of the first so that every rank runs the same number
    of passes."""
    mine = [(c, 1.0) for c in chunks[rank::world_size]]
    return mine + [(chunks[0], 0.0)] * (-(-len(chunks) // world_size) - len(mine))


def train_steps(strategy: Strategy, n: int, *, micro_step: MicroStep, stats: Sequence[str],
                normaliser: Callable[[list[int]], Normaliser], epochs: int, train_batch_size: int | None,
                micro_batching: MicroBatching, seed: int,
                progress: Callable[[int, int], None] | None = None) -> list[StepResult]:
    """Run ``epochs`` over ``n`` samples with ``strategy`` and return one StepResult per step.

    Args:
        micro_step: the loss of one micro-batch and its statistics (keys ``stats``), under the
            normaliser of its mini-batch.
        normaliser: the Normaliser of a mini-batch (its sample indices).
        train_batch_size: samples per optimizer step (None: all ``n``).
        micro_batching: how each mini-batch is cut into micro-batches (by count or by tokens).
        seed: seeds the per-epoch shuffle.
        progress: optional callable(done, total) at the start (0) and after each micro-batch
            of this rank (forward and backward), over all epochs and steps.
    Raises:
        ValueError: ``n`` is 0.
    """
    if n == 0:
        raise ValueError("the update got no samples")
    schedule = [(epoch, mini, micro_batching.cut(mini))
                for epoch, mini in minibatches(n, epochs=epochs, batch_size=train_batch_size or n, seed=seed)]
    passes = sum(-(-len(chunks) // strategy.world_size) for _, _, chunks in schedule)
    done = 0
    if progress is not None:
        progress(0, passes)
    model = strategy.model
    results: list[StepResult] = []
    with strategy.training():
        model.train()
        for epoch, mini, chunks in schedule:
            norm = normaliser(mini)
            sums = dict.fromkeys(stats, 0.0)
            strategy.zero_grad()
            for idx, weight in rank_micro_batches(chunks, rank=strategy.rank, world_size=strategy.world_size):
                with strategy.autocast():
                    loss, values = micro_step(idx, norm)
                strategy.backward(loss * weight if weight != 1.0 else loss)
                done += 1
                if progress is not None:
                    progress(done, passes)
                if weight == 0.0:
                    continue
                for k, v in values.items():
                    sums[k] += v
            sums = dict(zip(sums, strategy.all_reduce_sum(list(sums.values()))))
            grad_norm = strategy.step()
            results.append(StepResult(step=len(results), epoch=epoch, sums=sums, grad_norm=grad_norm, lr=strategy.lr,
                                      norm=norm))
        model.eval()
    return results
