"""Built-in plugins. They use only the public plugin API (``rlhf``, ``rlhf.core``), exactly as a
third-party package would, and are listed in ``rlhf.core.plugin_host.loading.DEFAULT_PLUGINS``."""
