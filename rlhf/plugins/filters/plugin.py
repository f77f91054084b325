"""Registers the built-in sample filters through the public hook."""

from __future__ import annotations

from rlhf.api import hookimpl


@hookimpl
def register_sample_filters(register):
    register("dynamic", "rlhf.plugins.filters.dynamic:dynamic_filter",
             description="DAPO dynamic sampling: drop groups whose scores do not vary (or whose mean is outside "
                         "--filter-range)",
             config_cls="rlhf.plugins.filters.dynamic:DynamicFilterConfig", short_flags=("filter_range",))
