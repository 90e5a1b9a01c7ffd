"""rl-kernels' tooling, apart from the library: the command line (``rl-kernels``, :mod:`.cli`, with
what it shares with the benchmark in :mod:`.usage`), the benchmark (:mod:`.bench`), the regression
repros (:mod:`.repro`) and their bundled samples (:mod:`.bundled_samples`), the float64 oracles and
eager baselines that the tests, the repros and the benchmark measure against (:mod:`.reference`),
verl's own kernels as their comparison points (:mod:`.verl_kernels`), ``rl-kernels verl-check``
(:mod:`.verl_check`) and the measuring scripts' harness and door into the kernels' internals
(:mod:`.diag`, for ``scripts/``; not the library's API). None of them patches verl. Tooling imports
the library and the integrations; neither imports tooling (``tests/repo/test_layers.py``)."""
