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
