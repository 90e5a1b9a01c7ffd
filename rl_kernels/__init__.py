"""rl-kernels: fused linear + log-prob / entropy for RL training of LLMs.

Public API:
    linear_log_probs(hidden_states, weight, labels, *, temperature=1.0, ignore_index=-100,
                     return_entropy=True, backend="auto") -> LogProbsOutput(log_probs, entropy)
    log_probs_from_logits(logits, labels, *, temperature=1.0, ignore_index=-100,
                          inplace_backward=False) -> log_probs
    entropy_from_logits(logits, *, temperature=1.0) -> entropy
"""
from .api import LogProbsOutput, linear_log_probs
from .logits import entropy_from_logits, log_probs_from_logits

__version__ = "0.1.0"
__all__ = ["LogProbsOutput", "linear_log_probs", "log_probs_from_logits", "entropy_from_logits",
           "__version__"]
