"""The small core: hook specs, registries, plugin loading, data types. Nothing heavy is imported here."""
