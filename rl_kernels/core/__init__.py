"""The internals that the public functions, the autograd bodies, the kernels' launchers and the
integrations share, none of them public: ``validation`` (every input check and its error message,
``public_signature``), ``label_check`` (the deferred label check: label values checked in the
kernels, reported at the next call) and, the layer below the kernels (they import nothing of
rl_kernels above them, so ``rl_kernels.ops`` can use them), ``backends`` (the backend objects:
``auto``, Triton's availability and interpreter, each head family's implementations),
``label_flag`` (the flag word the kernels write a bad label's call id into) and ``_logging`` (the
package logger and log-once). This file imports nothing: importing one of them imports no other.
"""
