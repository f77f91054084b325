"""Built-in tool-call parsers (``--tool-parser``)."""
