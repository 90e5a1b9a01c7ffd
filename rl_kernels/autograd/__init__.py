"""Autograd Functions, one file per kernel family (forward, backward, and which kernel or torch
twin each calls). A family's Function is its one route, eager and under torch.compile: its backend
calls are ``torch.library`` custom ops while the compiler traces and plain calls otherwise (the
vocab-parallel Functions still have a compile-only twin of custom ops with their own autograd):

* ``linear``: the fused linear head (``LinearLogProbsFunction``; ``head_forward`` /
  ``head_backward`` are also the building blocks of the others);
* ``logits``: statistics of materialized logits (``LogitsStatsFunction``);
* ``jsd``: the two-head Jensen-Shannon divergence (``LinearJSDFunction``);
* ``vocab_parallel``: the vocab-sharded forms of the three (``VocabParallelLinearFunction``,
  ``VocabParallelLogitsFunction``, ``VocabParallelLseGatherFunction``) and the shard merges;
* ``backward_schedule``: how dh and dW are made from recomputed dlogits windows (shared);
* ``common``: first-order-only backward and the ignored-row selection (shared).
"""
