"""SDPO channel: hint self-distillation at tool-error sites through a generalized JSD.

The teacher is the policy itself conditioned on a hint inserted before the recovery turn;
the student is the policy without the hint. Both see the recovery tokens at the same
positions, and the loss compares their full next-token distributions there only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    token_clip: float | None = None,
) -> Tensor:
    """JSD_β(p_T, p_S) = β·KL(p_T‖m) + (1−β)·KL(p_S‖m), m = β·p_T + (1−β)·p_S, batchmean.

    TRL GKD's convention: β=0 is KL(p_T‖p_S), β=1 is KL(p_S‖p_T); `temperature` divides
    both logits; positions whose label is −100 are ignored; the sum over valid tokens is
    divided by their count (by the batch size when `labels` is None). `token_clip` caps
    each token's divergence so one wildly off token cannot dominate the step.
    """
    student = F.log_softmax(student_logits / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        per_token = F.kl_div(student, teacher, reduction="none", log_target=True).sum(-1)
    elif beta == 1:
        per_token = F.kl_div(teacher, student, reduction="none", log_target=True).sum(-1)
    else:
        b = torch.tensor(beta, dtype=student.dtype, device=student.device)
        mixture = torch.logsumexp(torch.stack([student + torch.log1p(-b), teacher + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(mixture, teacher, reduction="none", log_target=True).sum(-1)
        kl_student = F.kl_div(mixture, student, reduction="none", log_target=True).sum(-1)
        per_token = b * kl_teacher + (1 - b) * kl_student
    if token_clip is not None:
        per_token = per_token.clamp(max=token_clip)
    if labels is None:
        return per_token.sum() / per_token.size(0)
    valid = labels != -100
    return per_token[valid].sum() / valid.sum()
