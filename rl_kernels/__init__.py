"""rl-kernels: fused linear + log-prob / entropy for RL training of LLMs.

Public API:
    linear_log_probs(hidden_states, weight, labels, *, temperature=1.0, ignore_index=-100,
                     return_entropy=True, return_sum_pi_squared=False, backend="auto")
        -> LogProbsOutput(log_probs, entropy, sum_pi_squared)
    log_probs_from_logits(logits, labels, *, temperature=1.0, ignore_index=-100,
                          inplace_backward=False) -> log_probs
    entropy_from_logits(logits, *, temperature=1.0) -> entropy
    logsumexp(logits, *, temperature=1.0) -> lse
    logits_stats(logits, labels=None, *, temperature=1.0, ignore_index=-100, return_entropy=True,
                 return_sum_pi_squared=False, inplace_backward=False)
        -> LogitsStats(log_probs, entropy, lse, sum_pi_squared)
    sum_pi_squared_from_logits(logits, *, temperature=1.0) -> sum_j p_j^2
    cross_entropy(logits, labels, *, ignore_index=-100, reduction="mean", label_smoothing=0.0)
    linear_topk_kl(hidden_states, weight, teacher_token_ids, teacher_log_probs, *, mask=None,
                   temperature=1.0, kind="forward", renormalize_teacher=False,
                   reduction="batchmean") -> loss
    linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, *, beta=0.5,
               temperature=1.0, labels=None, ignore_index=-100, reduction="mean") -> loss
"""
from .api import LogProbsOutput, linear_log_probs
from .distill import linear_jsd, linear_topk_kl
from .logits import (LogitsStats, cross_entropy, entropy_from_logits, log_probs_from_logits, logits_stats, logsumexp,
                     sum_pi_squared_from_logits)

__version__ = "0.1.0"
__all__ = ["LogProbsOutput", "LogitsStats", "linear_log_probs", "log_probs_from_logits", "entropy_from_logits",
           "logsumexp", "logits_stats", "sum_pi_squared_from_logits", "cross_entropy", "linear_topk_kl", "linear_jsd", "__version__"]
