"""The plugin host: hook specs, component kinds, typed registries, plugin loading, how a component's
settings are filled, references to objects by name, protocol checks and the plugin fingerprint.
Nothing heavy at import time.
"""
