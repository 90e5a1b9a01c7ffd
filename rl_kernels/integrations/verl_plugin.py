"""The ``verl.plugins`` entry point of rl-kernels (``pyproject.toml``): verl 0.9.1 and main import it
at ``import verl`` in every process. Its import only calls :func:`rl_kernels.integrations.verl_impl.modes.register`
(an import hook that adds the ``forward_kl_topk_tail`` loss mode to verl's registry when verl's
distillation losses are imported): nothing of verl is imported or patched here; rl-kernels' kernels
serve verl only where ``external_lib=rl_kernels.integrations.verl`` imports the patch. Also usable as
``VERL_USE_EXTERNAL_MODULES=rl_kernels.integrations.verl_plugin``."""
from __future__ import annotations

from .verl_impl.modes import register

register()
