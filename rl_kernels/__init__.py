"""rl-kernels: fused linear + log-prob / entropy for RL training of LLMs.

Public API:
    linear_log_probs(hidden_states, weight, labels, *, temperature=1.0, ignore_index=-100,
                     return_entropy=True, backend="auto") -> LogProbsOutput(log_probs, entropy)
"""
from .api import LogProbsOutput, linear_log_probs

__version__ = "0.1.0"
__all__ = ["LogProbsOutput", "linear_log_probs", "__version__"]
