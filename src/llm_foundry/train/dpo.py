"""Preference tuning: the DPO family of losses as pure functions of log-probabilities.

A batch holds B preference pairs as 2B rows, the B chosen completions first and then the B
rejected ones (each row: its prompt, then the completion; targets IGNORE outside the completion).
A row's log-probability is the sum over its completion tokens of log p(token | what precedes it),
under the policy being trained and under a frozen reference (the starting weights). With

    h = (log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))

the losses, averaged over the pairs, are

    sigmoid  -(1 - eps) log s(beta h) - eps log s(-beta h)     DPO (Rafailov et al. 2023); eps > 0
                                                                is conservative DPO (Mitchell 2023)
    robust   (-(1 - eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps)
                                                                rDPO, unbiased under flipped labels
                                                                (Chowdhury et al. 2024)
    ipo      (h' - 1 / (2 beta))^2, h' = h with each log-ratio  IPO (Azar et al. 2023), the
             divided by its completion's token count            per-token form TRL uses

and the implicit rewards are beta times each completion's log-ratio.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from llm_foundry.data.batches import IGNORE

STAT_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (N, T, V), targets (N, T) with IGNORE where a position does not count -> (N,):
    each row's summed log-probability of its counted targets, in fp32 (fp64 for fp64 logits)."""
    mask = targets != IGNORE  # (N, T)
    safe = targets.masked_fill(~mask, 0)  # any valid id: gathered, then zeroed by the mask
    # at least fp32 whatever autocast gave (fp64 stays fp64)
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    picked = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)  # (N, T)
    return (picked * mask).sum(-1)


def completion_lengths(targets: torch.Tensor) -> torch.Tensor:
    """targets (N, T) -> (N,) fp32: each row's number of counted targets (completion tokens)."""
    return (targets != IGNORE).sum(-1).float()


# Each loss: h (B,), the per-token h (B,), beta, eps -> the per-pair loss (B,).
def sigmoid_loss(h: torch.Tensor, h_tok: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


def robust_loss(h: torch.Tensor, h_tok: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)


def ipo_loss(h: torch.Tensor, h_tok: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return (h_tok - 1 / (2 * beta)) ** 2


# train.dpo_loss -> its per-pair loss
LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "sigmoid": sigmoid_loss,
    "robust": robust_loss,
    "ipo": ipo_loss,
}


def preference_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    lengths: torch.Tensor,
    kind: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """policy_logps, reference_logps, lengths: (2B,), the B chosen rows then the B rejected ->
    (the mean loss over the B pairs (a scalar with the policy's gradient), the batch's means of
    STAT_NAMES, detached). ``kind`` names a loss of LOSSES."""
    chosen, rejected = policy_logps.chunk(2)  # (B,) each
    ref_chosen, ref_rejected = reference_logps.detach().chunk(2)
    len_chosen, len_rejected = lengths.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected  # (B,)
    h = chosen_ratio - rejected_ratio
    # IPO's per-token log-ratios; a row with no completion token would divide by 0 (never drawn)
    h_tok = chosen_ratio / len_chosen.clamp(min=1) - rejected_ratio / len_rejected.clamp(min=1)
    loss = LOSSES[kind](h, h_tok, beta, label_smoothing).mean()
    r_chosen, r_rejected = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats = {
        "rewards/chosen": r_chosen.mean(),
        "rewards/rejected": r_rejected.mean(),
        "rewards/margins": (r_chosen - r_rejected).mean(),
        "rewards/accuracies": (r_chosen > r_rejected).float().mean(),
        "logps/chosen": chosen.detach().mean(),
        "logps/rejected": rejected.detach().mean(),
    }
    return loss, stats
