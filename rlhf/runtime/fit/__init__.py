"""The offline fit loop (DESIGN §14): ``fit(config)`` trains one model with one objective plugin."""
