"""The written contracts of the components the runtime drives: model adapters, training backends,
rollout engines, objectives, environments, and the roles of a run.
"""
