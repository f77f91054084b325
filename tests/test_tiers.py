"""Every test is in exactly one tier (unit, run, cluster): tests/conftest.py stops collection at a test
with none or with two, naming the test and the three tiers; a file's mark and a test's own both count."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

# A test folder of its own that collects with this suite's hook and registers the markers as pyproject.toml does.
CONFTEST = "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
INI = "[pytest]\naddopts = --strict-markers\nmarkers =\n    unit\n    run\n    cluster\n    ray\n"


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    return pytester


def test_a_file_mark_or_a_tests_own_mark_puts_each_test_in_one_tier(suite):
    suite.makepyfile(
        test_whole_file="""
            import pytest

            pytestmark = [pytest.mark.unit, pytest.mark.ray]  # a requirement marker beside the tier

            def test_one():
                pass
        """,
        test_mixed_file="""
            import pytest

            @pytest.mark.run
            def test_trains():
                pass

            @pytest.mark.cluster
            @pytest.mark.parametrize("n", [1, 2])
            def test_two_processes(n):
                pass
        """,
    )
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=4)
    suite.runpytest("-p", "no:cacheprovider", "-m", "unit").assert_outcomes(passed=1, deselected=3)
    suite.runpytest("-p", "no:cacheprovider", "-m", "cluster").assert_outcomes(passed=2, deselected=2)


def test_a_test_without_a_tier_or_with_two_is_a_collection_error_and_nothing_runs(suite):
    suite.makepyfile(
        test_wrong="""
            import pytest

            pytestmark = pytest.mark.unit

            def test_fine():
                pass

            @pytest.mark.run
            def test_in_two_tiers():
                pass
        """,
        test_bare="""
            def test_in_none():
                pass
        """,
    )
    tiers = ("exactly one of `unit` (no model is trained or generated from; seconds), `run` (trains or generates "
             "with a tiny model), `cluster` (starts Ray, torchrun or DeepSpeed processes)")
    for selection in ([], ["-m", "unit"]):  # a test in no tier is caught before -m leaves it out
        result = suite.runpytest("-p", "no:cacheprovider", *selection)
        assert result.ret == pytest.ExitCode.INTERRUPTED
        result.stdout.fnmatch_lines([
            "test_bare.py::test_in_none is in no tier: mark its file (`pytestmark = pytest.mark.unit`), or the test "
            f"itself where its file mixes tiers, with {tiers}",
            "test_wrong.py::test_in_two_tiers is in the tiers run and unit: mark its file *",
            "*Interrupted: 2 errors during collection*",
        ])
        assert "passed" not in result.stdout.str()
