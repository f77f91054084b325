#!/usr/bin/env bash
# The fast-path and model tests against the oldest transformers that pyproject.toml allows.
#
# The fast paths read a few transformers internals (rlhf/fastpaths/llama_like.py) and the model
# adapter relies on how `generate` and `from_pretrained` behave; the main test run sees only the
# newest transformers. This makes a second virtualenv holding that oldest transformers (and the
# hub, tokenizers and datasets versions it needs), which finds everything else (torch, peft, ...)
# in the main one, and runs tests/fastpaths and tests/models there.
#
#   bash tools/oldest_transformers.sh [MAIN_VENV]     (default: .venv, as .ci/run makes it)
set -euo pipefail
cd "$(dirname "$0")/.."
main=${1:-.venv}
old=.venv-oldest-transformers
start=$SECONDS

version=$("$main/bin/python" - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = next(d for d in deps if re.match(r"transformers\b", d))
print(re.search(r">=\s*([0-9][0-9.]*)", spec).group(1))
PY
)
echo "oldest transformers: $version"
rm -rf "$old"
python3 -m venv "$old"
"$old/bin/pip" install --quiet "transformers==$version" "huggingface-hub<1" httpx
"$old/bin/pip" install --quiet --no-deps "datasets<5"
main_site=$("$main/bin/python" -c "import site; print(site.getsitepackages()[0])")
old_site=$("$old/bin/python" -c "import site; print(site.getsitepackages()[0])")
echo "$main_site" > "$old_site/zz_main_venv.pth"  # after the old venv's own packages: they win
"$old/bin/python" -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
PYTHONPATH="$PWD" "$old/bin/python" -m pytest -q -p no:cacheprovider -n 2 tests/fastpaths tests/models
echo "oldest transformers: $((SECONDS - start)) s"
