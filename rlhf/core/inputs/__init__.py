"""What users hand the run, read so that it cannot hurt it: configuration YAML without aliases or
python tags and nested to a bound (`safe_yaml`), and text cut to what a token budget can keep
before a tokenizer sees it (`text_bounds`). No torch at import time."""
