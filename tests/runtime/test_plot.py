"""``rlhf plot``: the curves of one or several runs as a PNG; what it picks, smooths and refuses."""

from __future__ import annotations

import json
import math

import pytest

from rlhf.core.errors import ConfigError
from rlhf.runtime.run.plot import choose_metrics, series, smooth
from tests.helpers import run_cli

pytestmark = pytest.mark.unit


def write_run(path, rows):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rl_rows(offset=0.0):
    rows = [{"step": 0, "eval/reward/mean": 0.1 + offset}]
    rows += [{"step": s, "reward/mean": s / 10 + offset, "kl/mean": 0.01 * s, "response/length_mean": 10.0 - s,
              "policy/loss": 0.5} for s in range(1, 6)]
    return rows + [{"step": 5, "eval/reward/mean": 0.6 + offset}]


def test_smoothing_is_a_moving_average_started_at_the_first_value():
    assert smooth([1.0, 3.0, 3.0], 0.5) == [1.0, 2.0, 2.5]
    assert smooth([2.0, 4.0], 0.0) == [2.0, 4.0]


def test_a_series_is_the_rows_with_a_finite_number_for_the_metric():
    rows = [{"step": 1, "m": 1.0}, {"step": 2, "m": math.nan}, {"step": 3}, {"step": 4, "m": "x"}, {"step": 5, "m": 2}]
    assert series(rows, "m") == ([1, 5], [1.0, 2.0])


def test_the_default_panels_are_the_usual_curves_a_run_logged():
    assert choose_metrics({"step", "reward/mean", "kl/mean", "policy/loss", "eval/reward/mean", "time/step"},
                          None) == ["reward/mean", "kl/mean", "policy/loss", "eval/reward/mean"]
    assert choose_metrics({"step", "train/loss", "eval/loss", "train/lr"}, None) == ["train/loss", "eval/loss"]
    assert choose_metrics({"step", "train/lr"}, ["train/lr"]) == ["train/lr"]
    with pytest.raises(ConfigError, match="did you mean 'reward/mean'"):
        choose_metrics({"step", "reward/mean"}, ["rewrd/mean"])


def test_plot_writes_a_png_of_several_runs(tmp_path, plugins):
    import matplotlib.image

    first, second = write_run(tmp_path / "a", rl_rows()), write_run(tmp_path / "b", rl_rows(0.2))
    result = run_cli(plugins, ["plot", str(first), str(second)])
    assert result.exit_code == 0, result.output
    png = first / "curves.png"
    assert result.output.strip() == f"wrote {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(str(png)).shape
    assert width > height > 0  # five panels, three to a row
    result = run_cli(plugins, ["plot", str(first), "--metric", "kl/mean", "--out", str(tmp_path / "kl.png")])
    assert result.exit_code == 0 and (tmp_path / "kl.png").exists()


def test_plot_refuses_what_it_cannot_draw(tmp_path, plugins):
    result = run_cli(plugins, ["plot", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "no metrics.jsonl" in result.output
    run = write_run(tmp_path / "a", rl_rows())
    result = run_cli(plugins, ["plot", str(run), "--metric", "rewrd/mean"])
    assert result.exit_code == 2 and "did you mean 'reward/mean'" in result.output
    assert not (run / "curves.png").exists()
