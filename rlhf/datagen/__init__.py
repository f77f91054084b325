"""Generation jobs and data loops (docs/generate.md): ``rlhf generate`` (`generate.py`), ``rlhf score``
(`score.py`), ``rlhf iterate`` (`iterate.py`) and ``rlhf chat`` (`chat.py`); the output rows of
each mode (`rows.py`) and the resumable JSONL they are written to (`output.py`)."""
