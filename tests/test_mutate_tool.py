"""tools/mutate.py follows the code it mutates: every area's files and tests exist, and every curated
mutant's text occurs exactly once where it says (a move that loses one stops the tool's run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import mutate  # noqa: E402


def test_every_area_names_files_and_tests_that_exist():
    for area, (files, tests) in mutate.AREAS.items():
        missing = [path for path in [*files, *tests] if not (ROOT / path).exists()]
        assert not missing, f"{area}: {missing}"


def test_every_curated_mutant_applies_once():
    mutants = mutate.curated_mutants()
    assert len(mutants) == len(mutate.CURATED)
    for mutant, (file, text, replacement, _) in zip(mutants, mutate.CURATED):
        original = (ROOT / file).read_text()
        assert mutant.file == file and mutant.source == original.replace(text, replacement) != original


def test_every_focused_list_names_tests_that_exist():
    for area, tests in mutate.FOCUS.items():
        assert area in mutate.AREAS, area
        assert [test for test in tests if not (ROOT / test).exists()] == [], area


def test_since_draws_only_the_lines_a_change_added_or_changed(tmp_path):
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    source = tmp_path / "m.py"
    source.write_text("".join(f"x{i} = {i}\n" for i in range(1, 9)))
    git("init", "-q")
    git("add", "m.py")
    git("commit", "-qm", "one")
    lines = source.read_text().splitlines()
    lines[1] = "x2 = 20"  # line 2 changed
    lines[5:6] = ["x6 = 60", "x6b = 61"]  # line 6 changed, a line added after it (7)
    del lines[-1]  # the last line removed: nothing of today's file
    source.write_text("\n".join(lines) + "\n")
    assert mutate.changed_lines("HEAD", ["m.py"], root=tmp_path) == {"m.py": {2, 6, 7}}
    with pytest.raises(SystemExit, match="--since"):
        mutate.changed_lines("no-such-revision", ["m.py"], root=tmp_path)
