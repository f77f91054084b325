"""Off-policy generation for ``--async``: partial rollouts across weight versions, the logical clock
that decides each token's version, and the per-token staleness bound (docs/async.md)."""
