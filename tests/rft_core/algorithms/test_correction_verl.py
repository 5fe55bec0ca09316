"""The rollout correction's sequence-level truncated IS (``seq-tis``: product of the token ratios;
``geo-tis``: their geometric mean), mode ``none`` and the k1/k3 rejection masks (``rejection``;
Li et al. 2025, arXiv:2512.23075; verl ``rollout_rs``).

Each is checked against a float64 loop over the tokens written from the formula, by hand, and
against verl's own numbers (``data/verl_objectives.json``: ``compute_rollout_correction_and_rejection_mask``
at verl commit 1dda039b; the geometric IS weight of ``mismatch_helper.compute_rollout_importance_weights``
at verl commit 4bf4bd32, the last with it)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rft_core.algorithms import REJECTION_MASKS, ROLLOUT_CORRECTIONS, rollout_correction
from rft_core.algorithms.correction import check_rejection
from rft_core.config import ConfigError, load_config
from rft_core.config.algorithms import RolloutCorrectionConfig

D = torch.float64
DATA = json.loads((Path(__file__).parent / "data" / "verl_objectives.json").read_text())


def _inputs(seed: int, scale: float = 0.3, B: int = 5, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    rollout = -3.0 * torch.rand(B, T, generator=g, dtype=D)
    old = rollout + scale * torch.randn(B, T, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    return old, rollout, mask


def _rows(old, rollout, mask):
    """Per response, the list of its token log-ratios lr_t (plain floats)."""
    return [[float(old[i, t] - rollout[i, t]) for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


# ------------------------------------------------------------------------- sequence-level TIS
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode, cap, low", [("seq-tis", 1.5, None), ("seq-tis", 2.0, 0.7), ("geo-tis", 1.1, None),
                                            ("geo-tis", 1.05, 0.95)])
def test_sequence_tis_against_the_loop(seed, mode, cap, low):
    old, rollout, mask = _inputs(seed)
    out = rollout_correction(old, rollout, mask, mode=mode, cap=cap, low=low)
    want = torch.zeros_like(old)
    capped = 0
    for i, lrs in enumerate(_rows(old, rollout, mask)):
        s = sum(lrs) if mode == "seq-tis" else sum(lrs) / len(lrs)
        rho = math.exp(max(-20.0, min(20.0, s)))
        w = min(rho, cap) if low is None else min(max(rho, low), cap)
        capped += len(lrs) * (rho > cap or (low is not None and rho < low))
        for t in range(mask.shape[1]):
            if mask[i, t]:
                want[i, t] = w
    torch.testing.assert_close(out.weights, want, rtol=1e-13, atol=0)
    assert torch.equal(out.loss_mask, mask)  # truncation masks nothing
    assert out.metrics["rollout_is_capped_frac"] == pytest.approx(capped / int(mask.sum()))
    assert ROLLOUT_CORRECTIONS.info(mode).level == "sequence" and ROLLOUT_CORRECTIONS.info(mode).truncates


def test_sequence_tis_by_hand():
    """Ratios [[3, 1, 0.5], [2.5, 1.5, -]]: products 1.5 and 3.75, geometric means 1.5^(1/3) and sqrt(3.75)."""
    rollout = torch.log(torch.tensor([[0.1, 0.4, 0.6], [0.2, 0.4, 0.3]], dtype=D))
    old = rollout + torch.tensor([[3.0, 1.0, 0.5], [2.5, 1.5, 1.0]], dtype=D).log()
    mask = torch.tensor([[True, True, True], [True, True, False]])
    seq = rollout_correction(old, rollout, mask, mode="seq-tis", cap=2.0).weights
    torch.testing.assert_close(seq, torch.tensor([[1.5] * 3, [2.0, 2.0, 0.0]], dtype=D), rtol=0, atol=1e-14)
    geo = rollout_correction(old, rollout, mask, mode="geo-tis", cap=1.9).weights
    torch.testing.assert_close(geo, torch.tensor([[1.5 ** (1 / 3)] * 3, [1.9, 1.9, 0.0]], dtype=D), rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------- rejection masks
def _loop_keep(name, lrs, cap, low):
    """Whether each token of one response stays, from the definitions (k1: ratio bounds [low, cap];
    k3: k3 = e^lr - 1 - lr <= cap)."""
    lrs = [max(-20.0, min(20.0, x)) for x in lrs]
    k3 = [math.expm1(x) - x for x in lrs]
    if name == "token_k1":
        return [low <= math.exp(x) <= cap for x in lrs]
    if name == "token_k3":
        return [v <= cap for v in k3]
    stat = {"seq_sum_k1": math.exp(sum(lrs)), "seq_mean_k1": math.exp(sum(lrs) / len(lrs)), "seq_sum_k3": sum(k3),
            "seq_mean_k3": sum(k3) / len(k3), "seq_max_k3": max(k3)}[name]
    ok = low <= stat <= cap if name.endswith("k1") else stat <= cap
    return [ok] * len(lrs)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name, cap, low", [
    ("token_k1", 1.3, None), ("token_k1", 1.2, 0.6), ("seq_sum_k1", 1.5, 0.5), ("seq_mean_k1", 1.05, 0.9),
    ("token_k3", 0.03, None), ("seq_sum_k3", 0.2, None), ("seq_mean_k3", 0.03, None), ("seq_max_k3", 0.08, None),
])
def test_rejection_masks_against_the_loop(seed, name, cap, low):
    old, rollout, mask = _inputs(seed)
    base = rollout_correction(old, rollout, mask, mode="tis", cap=2.0)
    out = rollout_correction(old, rollout, mask, mode="tis", cap=2.0, rejection=name, rejection_cap=cap,
                             rejection_low=low)
    low_ = 1 / cap if low is None and name.endswith("k1") else low
    want = torch.zeros_like(mask)
    for i, lrs in enumerate(_rows(old, rollout, mask)):
        cols = [t for t in range(mask.shape[1]) if mask[i, t]]
        for t, ok in zip(cols, _loop_keep(name, lrs, cap, low_)):
            want[i, t] = ok
    assert torch.equal(out.loss_mask, want)
    assert want.any() and (mask & ~want).any()  # the mask acts, and keeps something
    torch.testing.assert_close(out.weights, torch.where(want, base.weights, 0.0), rtol=0, atol=0)
    assert out.metrics["rollout_is_token_masked_frac"] == pytest.approx(float((mask & ~want).sum()) / int(mask.sum()))
    if REJECTION_MASKS.info(name).level == "sequence":  # a whole response or nothing
        assert all(not (want[i] ^ mask[i]).any() or not want[i].any() for i in range(len(mask)))


def test_mode_none_and_rejection_by_hand():
    """lr = ln 3, 0, ln 0.5 | ln 2.5, ln 1.5: k3 = 3 - 1 - ln 3 = 0.901, 0, 0.5 - 1 + ln 2 = 0.193 | 0.584, 0.095."""
    rollout = torch.log(torch.tensor([[0.1, 0.4, 0.6], [0.2, 0.4, 0.3]], dtype=D))
    old = rollout + torch.tensor([[3.0, 1.0, 0.5], [2.5, 1.5, 1.0]], dtype=D).log()
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = rollout_correction(old, rollout, mask, mode="none", rejection="token_k3", rejection_cap=0.2)
    assert out.loss_mask.tolist() == [[False, True, True], [False, True, False]]
    torch.testing.assert_close(out.weights, out.loss_mask.to(D), rtol=0, atol=0)  # no weight: 1 where kept
    k1 = rollout_correction(old, rollout, mask, mode="none", rejection="token_k1", rejection_cap=2.0)  # [0.5, 2]
    assert k1.loss_mask.tolist() == [[False, True, True], [False, True, False]]
    seq = rollout_correction(old, rollout, mask, mode="none", rejection="seq_sum_k1", rejection_cap=3.0,
                             rejection_low=1.0)  # products 1.5 (kept) and 3.75 (out)
    assert seq.loss_mask.tolist() == [[True, True, True], [False, False, False]]
    assert seq.metrics["rollout_is_seq_masked_frac"] == 0.5


def test_rejection_refusals():
    old, rollout, mask = _inputs(0)
    with pytest.raises(ValueError, match="needs a rejection mask"):
        rollout_correction(old, rollout, mask, mode="none")
    for kw, match in (({"rejection": "token_k1"}, "rejection_cap"), ({"rejection": "token_k3", "rejection_cap": 0.1,
                                                                       "rejection_low": 0.01}, "from above only"),
                      ({"rejection": "token_k1", "rejection_cap": 0.9}, "rejection_cap must then be > 1"),
                      ({"rejection": "seq_sum_k1", "rejection_cap": 2.0, "rejection_low": 3.0}, "rejection_low < "),
                      ({"rejection_cap": 2.0}, "need a rejection mask")):
        with pytest.raises(ValueError, match=match):
            rollout_correction(old, rollout, mask, **kw)
    with pytest.raises(KeyError, match="seq_max_k3"):
        check_rejection("seq_max_k1", 2.0, None)


# ------------------------------------------------------------------------------- verl's numbers
def _tensors(case):
    i = case["inputs"]
    mask = torch.tensor(i["response_mask"], dtype=D)
    return torch.tensor(i["old_log_prob"], dtype=D), torch.tensor(i["rollout_log_prob"], dtype=D), mask > 0, mask


def test_verl_data_records_its_sources():
    assert DATA["verl_commit"].startswith("1dda039b") and DATA["verl_geometric_commit"].startswith("4bf4bd32")
    names = {c["rollout_rs"] for c in DATA["rollout_correction"]} - {None}
    assert names == set(REJECTION_MASKS.names())  # every mask has a verl case


@pytest.mark.parametrize("case", DATA["rollout_correction"] + DATA["geometric_is"], ids=lambda c: c["case"])
def test_matches_verl(case):
    """verl keeps the IS weights and the rejection mask apart (the loss multiplies both): ours are
    its weights times its mask, and its mask. verl's k1 bounds "lo_hi" are on pi_rollout / pi_old:
    the case's ``ours`` gives them on pi_old / pi_rollout (1 / hi, 1 / lo); verl's geometric mean
    divides by n + 1e-8 (rel 1e-9 to 1e-8 here)."""
    old, rollout, mask, mask_f = _tensors(case)
    out = rollout_correction(old, rollout, mask, **case["ours"])
    verl_mask = torch.tensor(case["verl_mask"], dtype=D)
    assert torch.equal(out.loss_mask, verl_mask > 0)
    if case["verl_weights"] is not None:
        want = torch.tensor(case["verl_weights"], dtype=D) * verl_mask
        torch.testing.assert_close(out.weights, want, rtol=1e-8 if case["case"].startswith("geo") else 1e-13, atol=0)
        raw = torch.tensor(case["verl_weights"], dtype=D)[mask]  # the truncation acts (but in the wide-cap case)
        assert bool((raw >= case["ours"]["cap"]).any()) == (case["case"] != "geo_tis_wide_cap")


def test_verl_k1_bounds_are_on_the_inverse_ratio():
    """verl's "0.7_1.6" keeps tokens with 0.7 <= pi_rollout / pi_old <= 1.6; read as bounds on
    pi_old / pi_rollout (this section's convention) it would keep other tokens."""
    case = next(c for c in DATA["rollout_correction"] if c["case"] == "token_k1_asymmetric")
    old, rollout, mask, _ = _tensors(case)
    literal = rollout_correction(old, rollout, mask, mode="none", rejection="token_k1", rejection_low=0.7,
                                 rejection_cap=1.6)
    assert not torch.equal(literal.loss_mask, torch.tensor(case["verl_mask"], dtype=D) > 0)


# ------------------------------------------------------------------------------------ config
def test_config_fields_reach_the_correction():
    cfg = load_config(None, {"update.rollout_correction": {"enabled": True, "mode": "geo-tis", "cap": 1.1,
                                                           "rejection": "seq_mean_k3", "rejection_cap": 0.01},
                             "logprobs.recompute_old_logprobs": True})
    rc = cfg.update.rollout_correction
    assert rc.correction_kwargs() == {"mode": "geo-tis", "cap": 1.1, "low": None, "rejection": "seq_mean_k3",
                                      "rejection_cap": 0.01, "rejection_low": None}
    assert RolloutCorrectionConfig().correction_kwargs()["rejection"] is None
    for bad, match in (({"mode": "none"}, "mode=none .*rejection"), ({"rejection": "seq_k9"}, "unknown rollout rejection"),
                       ({"rejection": "token_k3"}, "rejection_cap"),
                       ({"rejection": "seq_sum_k3", "rejection_cap": 1.0, "rejection_low": 0.5}, "rejection_low")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, {"update.rollout_correction": bad})


def test_update_applies_the_rejection_mask():
    """``rollout_correction_weights`` (the update's) passes the rejection fields through."""
    from rft_core.training.update import UpdateData, rollout_correction_weights

    old, rollout, mask = _inputs(3)
    rows = [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(len(mask))]
    data = UpdateData(prompts=[[1]] * len(rows), responses=[[5] * len(r) for r in rows],
                      old_logprobs=[[float(old[i, t]) for t in r] for i, r in enumerate(rows)],
                      advantages=[[1.0] * len(r) for r in rows],
                      rollout_logprobs=[[float(rollout[i, t]) for t in r] for i, r in enumerate(rows)])
    corr = rollout_correction_weights(data, mode="tis", cap=2.0, rejection="token_k3", rejection_cap=0.03)
    k3 = [[math.expm1(o - q) - (o - q) for o, q in zip(a, b)] for a, b in zip(data.old_logprobs, data.rollout_logprobs)]
    assert [k.tolist() for k in corr.keep] == [[v <= 0.03 for v in row] for row in k3]
    assert any(not all(k.tolist()) for k in corr.keep)
