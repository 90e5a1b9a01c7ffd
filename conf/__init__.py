"""Hydra config group ``rl_kernels`` for verl's entry point, shipped as package data.

Installed package (any working directory)::

    python -m verl.trainer.main_ppo 'hydra.searchpath=[pkg://rl_kernels.integrations.conf]' +rl_kernels=fused ...

From the root of a clone, ``--config-dir conf`` works too (this directory; the wheel ships these
same files as the package ``rl_kernels.integrations.conf``). Options:
``fused``, ``logits``, ``fused_anomaly`` (``rl_kernels/*.yaml`` here; see README.md next to them).
This module only marks the directory as a package for Hydra's ``pkg://`` search path.
"""
