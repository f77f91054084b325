"""``rlhf view``: a local page to look at runs' curves, samples and tokens (rlhf/viewer/, docs/runs.md)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("view", short_help="Look at runs' curves, samples and tokens in a local web page.",
               context_settings={"max_content_width": 120})
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port on 127.0.0.1 to serve on (0: a free one)")
@click.option("--open", "open_browser", is_flag=True, help="Open the page in the default browser")
@click.option("--export", "export", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the page as one self-contained HTML file instead of serving it")
@click.option("--steps", default=None, help="With --export: the steps to include, e.g. 5, 1,5,9 or 10-20 "
              "(default: the last 10)")
def view_command(runs: tuple[Path, ...], port: int, open_browser: bool, export: Path | None,
                 steps: str | None) -> None:
    """Serve a page about RUN directories on 127.0.0.1: curves (several runs overlaid), each step's
    samples (sortable, filterable), a prompt's group, a sample's tokens coloured by log-prob,
    advantage, KL, mask, origin or version, the same prompt across steps and runs. It follows a
    run that is still writing. Ctrl-C stops it.

    \b
    rlhf view runs/quickstart
    rlhf view runs/a runs/b --port 8765
    rlhf view runs/quickstart --export report.html --steps 1,50,100
    """
    from rlhf.core.errors import ConfigError
    from rlhf.viewer.runs import open_runs

    if steps is not None and export is None:
        raise ConfigError("--steps chooses the steps of --export FILE.html; the server shows every step")
    opened = open_runs(list(runs))
    if export is not None:
        from rlhf.viewer.export import export_html, parse_steps

        click.echo(f"wrote {export_html(opened, export, parse_steps(steps) if steps else None)}")
        return
    from rlhf.viewer.server import ViewServer

    try:
        server = ViewServer(opened, port=port)
    except OSError as exc:
        raise ConfigError(f"--port {port}: cannot listen there ({exc.strerror or exc}); choose another, or 0 "
                          "for a free one") from None
    click.echo(f"rlhf view: {server.url}  (Ctrl-C stops it)")
    if open_browser:
        import webbrowser

        webbrowser.open(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
