"""``rlhf plot``: a run's curves as a PNG (rlhf/runtime/run/plot.py)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("plot", short_help="Plot runs' curves (reward, KL, length, loss, eval) to a PNG.",
               context_settings={"max_content_width": 120})
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--metric", "metrics", multiple=True,
              help="A metrics.jsonl key to plot (repeatable; default: reward, KL, length, loss and eval curves)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG file to write (default: <first run>/curves.png)")
@click.option("--smoothing", type=float, default=0.6, show_default=True,
              help="Weight of the moving average drawn over the raw values (0: none)")
def plot_command(runs: tuple[Path, ...], metrics: tuple[str, ...], out: Path | None, smoothing: float) -> None:
    """Plot RUN directories' curves over steps into one PNG, one line per run.

    \b
    rlhf plot runs/quickstart
    rlhf plot runs/a runs/b --metric reward/mean --metric eval/pass@1 --out compare.png
    """
    from rlhf.runtime.run.plot import plot_runs

    click.echo(f"wrote {plot_runs(list(runs), metrics=list(metrics) or None, out=out, smoothing=smoothing)}")
