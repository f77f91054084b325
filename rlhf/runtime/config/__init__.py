"""Configuration and planning: the options every command shares, each loop's config dataclass, and the
plans that resolve and check a run's components before any model loads.
"""
