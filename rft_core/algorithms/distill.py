"""On-policy distillation: the teacher's per-token signal on the student's own sampled tokens.

The student samples y ~ pi_old; a teacher nu scores the same tokens (the ``teacher_logprobs``
stage); each action token gets the signal

    d_t = -(log pi_old(y_t | s_t) - log nu(y_t | s_t)),

the negative of the single-sample (k1) estimate of the reverse KL at that state:
E_{y_t ~ pi_old}[-d_t] = KL(pi_old(.|s_t) || nu(.|s_t)). It is used as a per-token advantage
with the policy-gradient loss, so that its expected gradient lowers the reverse KL of the
student to the teacher on the states the student visits:

- Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
  Mistakes" (GKD, arXiv:2306.13649, sec. 3): on-policy student samples (its student-data
  fraction lambda = 1), a token-level divergence to the teacher, the reverse KL among the
  choices, and its combination with an RL reward. GKD back-propagates the full distribution's
  divergence; here, as below, only its sampled-token estimate is used, as a reward.
- Thinking Machines Lab (Lu et al. 2025, "On-policy distillation"): exactly the per-token
  advantage -(log pi_student - log pi_teacher) of the sampled tokens with the policy-gradient
  loss, discount 0 (each token's own signal, no sum over the tokens after it), optionally added
  to the task reward's advantage.
- The Qwen3 technical report (arXiv:2505.09388, "Strong-to-Weak Distillation", its on-policy
  phase): the small models sample and are trained to match the flagship teacher's logits on
  those samples by minimising the KL (the full-logit form, as GKD's).
- verl (docs/algo/opd.md, "PG OPD", verl-project/verl at 01dcf9f): reward
  r_t = sg(log nu(y_t) - log pi_theta(y_t)) with the k1 estimator, the teacher at temperature 1.
  Where this departs: verl takes log pi_theta of the current parameters inside its loss and adds
  a separate clipped distillation loss to the task's PPO loss (``policy_loss +
  distillation_loss_coef * distill_loss``); here d_t uses pi_old (the policy that sampled, as
  Thinking Machines) and goes into the advantages, ``A_t = A^task_t + coef * d_t``, trained by
  the configured policy loss. Without clipping (one optimizer step per rollout, the ratio 1 at
  that step) the two give the same gradient; with clipping verl clips the two terms separately,
  this clips their sum. verl also always scores the teacher at temperature 1 while the student's
  log-probs are at the rollout temperature; here the teacher is scored at the rollout temperature
  unless ``teacher.temperature`` says otherwise, so that a student equal to its teacher gets
  d_t = 0 (verl's own debugging advice, "the loss should be approximately zero", holds only at
  rollout temperature 1).
"""
from __future__ import annotations

import torch

from rft_core.algorithms.masked import masked_mean


def reverse_kl_signal(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                      action_mask: torch.Tensor) -> torch.Tensor:
    """The per-token distillation signal d_t = -(log pi_old(y_t) - log nu(y_t)) (module docstring).

    Args:
        old_logprobs: (B, T) float, log pi_old of the sampled tokens (nats; the student at the
            rollout temperature).
        teacher_logprobs: (B, T) float, log nu of the same tokens under the teacher (nats).
        action_mask: (B, T) bool, the tokens the student sampled (multi-turn: not observations).
    Returns:
        (B, T) in the inputs' dtype: d_t on action tokens, 0 elsewhere. d_t > 0 where the teacher
        gives the sampled token more probability than the student.
    Raises:
        ValueError: the shapes differ.
    """
    if not old_logprobs.shape == teacher_logprobs.shape == action_mask.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, teacher_logprobs {tuple(teacher_logprobs.shape)} "
                         f"and action_mask {tuple(action_mask.shape)} must have one shape (B, T)")
    d = teacher_logprobs - old_logprobs
    return torch.where(action_mask, d, torch.zeros((), dtype=d.dtype, device=d.device))


def distillation_advantages(task_advantages: torch.Tensor, task_returns: torch.Tensor, old_logprobs: torch.Tensor,
                            teacher_logprobs: torch.Tensor, action_mask: torch.Tensor, *, coef: float,
                            use_task_rewards: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The advantages with the distillation signal: A_t = A^task_t + coef * d_t, or with
    ``use_task_rewards`` False A_t = coef * d_t alone (``reverse_kl_signal``; discount 0: each
    token's own signal).

    Args:
        task_advantages, task_returns: (B, T) float, the task reward's advantages and returns
            (every shaping step applied), zero off the action tokens.
        old_logprobs, teacher_logprobs, action_mask: see ``reverse_kl_signal``.
        coef: weight of the signal (> 0; verl's ``distillation_loss_coef``).
        use_task_rewards: keep the task advantages (True) or train on the signal alone.
    Returns:
        (advantages, returns, metrics): (B, T) each, zero off the action tokens; the returns are
        the task returns, or with ``use_task_rewards`` False the advantages (with discount 0 a
        token's return is its own signal); metrics ``distill_reverse_kl`` (mean over action tokens
        of log pi_old - log nu, the k1 estimate of KL(pi_old || nu) per token, nats) and
        ``distill_advantage_mean`` (mean of coef * d_t over action tokens).
    Raises:
        ValueError: ``coef`` <= 0 or the shapes differ.
    """
    if not coef > 0:
        raise ValueError(f"distillation coef must be > 0, got {coef}")
    d = reverse_kl_signal(old_logprobs, teacher_logprobs, action_mask)
    signal = coef * d.to(task_advantages.dtype)
    if use_task_rewards:
        adv, ret = task_advantages + signal, task_returns
    else:
        adv = signal
        ret = signal.clone()
    metrics = {"distill_reverse_kl": float(masked_mean(-d, action_mask)),
               "distill_advantage_mean": float(masked_mean(signal, action_mask))}
    return adv, ret, metrics
