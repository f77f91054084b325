"""The plugin kit: what a plugin author runs. ``rlhf plugins check`` (the contract of every kind,
on CPU with synthetic inputs: `rlhf.plugin_kit.checks`) and ``rlhf plugins new`` (a package to
start from: `rlhf.plugin_kit.scaffold`, templates under ``templates/``).

Host code: it reaches plugins only through registries, like the runtime.
"""
