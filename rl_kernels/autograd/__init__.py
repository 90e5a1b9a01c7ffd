"""Autograd Functions, one file per kernel family (forward, backward, and which kernel or torch
twin each calls). A family's Function is its one route, eager and under torch.compile, sharded
over a vocab-parallel group or not: its backend calls are ``torch.library`` custom ops while the
compiler traces and plain calls otherwise:

* ``linear``: the fused linear head (``LinearHeadFunction``, applied by ``linear_head``, with the
  logits at given ids for the distillation losses; ``head_forward`` / ``head_backward`` are also the
  JSD's building blocks);
* ``logits``: statistics of materialized logits and their log-probs at given token ids (the
  top-K losses) (``LogitsStatsFunction``);
* ``linear_jsd``: the two-head Jensen-Shannon divergence (``LinearJSDFunction``);
* ``linear_topk``: the fused top-K selection (no gradient: ``linear_topk_call``, no Function);
* ``vocab_parallel``: what the families share for a vocab shard: the layout, the collectives and
  the merge of the shards' statistics (no Function of its own);
* ``positions``: the losses' rule for which positions count, and its value checks;
* ``backward_schedule``: how dh and dW are made from recomputed dlogits windows (shared);
* ``head_family``: what the families share: ``kernels`` (a family's kernel module on a backend,
  ``ops.<family>`` or ``torch_ops.<family>``, the same function names), first-order-only backward,
  the ignored-row selection, and the custom ops' helpers (``stage_op``, ``plain_op``, ``OpArgs``;
  ``OPS``, every op made).
"""
