"""rl-kernels: fused linear + log-prob / entropy for RL training of LLMs.

Public API (every function; signatures exactly as defined, checked by tests/test_public_api.py):

    linear_log_probs(hidden_states, weight, labels, *, temperature=1.0, softcap=None,
                     ignore_index=-100, return_entropy=True, return_sum_pi_squared=False,
                     backend='auto', process_group=None, vocab_start_index=None,
                     reduce_hidden_grad=False)
        -> LogProbsOutput(log_probs, entropy, sum_pi_squared)
    logits_stats(logits, labels=None, *, temperature=1.0, ignore_index=-100, return_entropy=True,
                 return_sum_pi_squared=False, inplace_backward=False, backend='auto',
                 process_group=None, vocab_start_index=None)
        -> LogitsStats(log_probs, entropy, lse, sum_pi_squared)
    log_probs_from_logits(logits, labels, *, temperature=1.0, ignore_index=-100,
                          inplace_backward=False, backend='auto', process_group=None,
                          vocab_start_index=None) -> log_probs
    entropy_from_logits(logits, *, temperature=1.0, backend='auto', process_group=None,
                        vocab_start_index=None) -> entropy
    logsumexp(logits, *, temperature=1.0, backend='auto', process_group=None,
              vocab_start_index=None) -> lse
    sum_pi_squared_from_logits(logits, *, temperature=1.0, backend='auto', process_group=None,
                               vocab_start_index=None) -> sum_j p_j^2
    cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0,
                  inplace_backward=False, reduction='mean', backend='auto') -> loss
    linear_topk_kl(hidden_states, weight, teacher_token_ids, teacher_log_probs, *,
                   temperature=1.0, labels=None, ignore_index=-100, mask=None, kind='forward',
                   renormalize_teacher=False, reduction='mean', backend='auto',
                   process_group=None, vocab_start_index=None, reduce_hidden_grad=False) -> loss
    linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, *,
               temperature=1.0, labels=None, ignore_index=-100, mask=None, beta=0.5,
               reduction='mean', backend='auto', process_group=None, vocab_start_index=None,
               reduce_hidden_grad=False) -> loss

Conventions, the same in every function:
  * tensors are positional; every other argument is keyword-only, in this order: temperature
    (and softcap, the rest of the logits' definition, where a function has it);
    which positions count (labels, ignore_index, mask); the function's own options; reduction;
    backend; the vocab-parallel trio (process_group, vocab_start_index, reduce_hidden_grad);
  * a position counts unless its label equals ``ignore_index`` (-100); the two distillation
    losses, which need no labels, also take a ``mask`` (1 = counts), and with both given a
    position counts when both say so;
  * losses default to ``reduction='mean'`` over the positions that count;
  * ``weight`` is always an lm_head weight (V, H); outputs are float32 in nats.
"""
from .distill import linear_jsd, linear_topk_kl
from .linear import LogProbsOutput, linear_log_probs
from .logits import (LogitsStats, cross_entropy, entropy_from_logits, log_probs_from_logits, logits_stats, logsumexp,
                     sum_pi_squared_from_logits)

__version__ = "0.1.0"
__all__ = ["LogProbsOutput", "LogitsStats", "linear_log_probs", "log_probs_from_logits", "entropy_from_logits",
           "logsumexp", "logits_stats", "sum_pi_squared_from_logits", "cross_entropy", "linear_topk_kl", "linear_jsd",
           "__version__"]
