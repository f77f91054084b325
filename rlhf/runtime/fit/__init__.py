"""The offline fit loop (docs/objectives.md): ``fit(config)`` trains one model with one objective plugin."""
