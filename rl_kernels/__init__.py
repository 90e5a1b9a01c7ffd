"""rl-kernels: fused linear + log-prob / entropy for RL training of LLMs.

Public API:
    linear_log_probs(hidden_states, weight, labels, *, temperature=1.0, ignore_index=-100,
                     return_entropy=True, backend="auto") -> LogProbsOutput(log_probs, entropy)
    log_probs_from_logits(logits, labels, *, temperature=1.0, ignore_index=-100,
                          inplace_backward=False) -> log_probs
    entropy_from_logits(logits, *, temperature=1.0) -> entropy
    logsumexp(logits, *, temperature=1.0) -> lse
    logits_stats(logits, labels=None, *, temperature=1.0, ignore_index=-100, return_entropy=True,
                 inplace_backward=False) -> LogitsStats(log_probs, entropy, lse)
    cross_entropy(logits, labels, *, ignore_index=-100, reduction="mean", label_smoothing=0.0)
    linear_topk_kl(hidden_states, weight, teacher_token_ids, teacher_log_probs, *, mask=None,
                   temperature=1.0, kind="forward", renormalize_teacher=False,
                   reduction="batchmean") -> loss
    linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, *, beta=0.5,
               temperature=1.0, labels=None, ignore_index=-100, reduction="mean") -> loss
"""
from .api import LogProbsOutput, linear_log_probs
from .distill import linear_jsd, linear_topk_kl
from .logits import LogitsStats, cross_entropy, entropy_from_logits, log_probs_from_logits, logits_stats, logsumexp

__version__ = "0.1.0"
__all__ = ["LogProbsOutput", "LogitsStats", "linear_log_probs", "log_probs_from_logits", "entropy_from_logits",
           "logsumexp", "logits_stats", "cross_entropy", "linear_topk_kl", "linear_jsd", "__version__"]
