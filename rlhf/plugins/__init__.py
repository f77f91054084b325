"""Built-in plugins. They import rlhf only through the plugin API, ``rlhf.api`` (and ``rlhf.sandbox``),
exactly as a third-party package would, and are listed in ``rlhf.core.plugin_host.loading.DEFAULT_PLUGINS``."""
