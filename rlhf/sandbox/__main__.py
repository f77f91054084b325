"""``python -m rlhf.sandbox 'print(1)' [timeout_s]``: one sandboxed run, its result as JSON."""

import dataclasses
import json
import sys

from rlhf.sandbox import run_code

result = run_code(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read(),
                  timeout_s=float(sys.argv[2]) if len(sys.argv) > 2 else 10.0)
print(json.dumps(dataclasses.asdict(result), indent=2))
