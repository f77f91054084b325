"""``rlhf reward``: work with reward sources outside a run (serve one over HTTP)."""

from __future__ import annotations

import ipaddress
from typing import Any

import click

ON_ERROR = ("raise", "zero", "skip")


@click.group("reward", short_help="Serve a reward source over HTTP (rlhf reward serve).")
def reward_group() -> None:
    """Reward sources: serve one over HTTP for other trainers or machines."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@reward_group.command("serve")
@click.argument("spec")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback needs --token-env (or --allow-no-token)")
@click.option("--port", default=5000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to bind (0: any free port, printed at start)")
@click.option("--token-env", metavar="VAR", default=None,
              help="Require 'Authorization: Bearer $VAR' on every request (default: RLHF_REWARD_TOKEN when set)")
@click.option("--allow-no-token", is_flag=True,
              help="Serve on a non-loopback address without a token (refused otherwise)")
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=32.0, show_default=True,
              help="Largest request body (413 above)")
@click.option("--max-samples", type=click.IntRange(1), default=16384, show_default=True,
              help="Most samples in one request (400 above)")
@click.option("--max-depth", type=click.IntRange(1, 900), default=64, show_default=True,
              help="Deepest JSON nesting of a request (400 above)")
@click.option("--read-timeout-s", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds to receive a whole request; slower ones get 408 or are disconnected")
@click.option("--head-timeout-s", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds to receive a whole request head from its first byte; slower connections are closed")
@click.option("--max-head-kb", type=click.FloatRange(min=0, min_open=True), default=64.0, show_default=True,
              help="Largest request head (request line and headers; 431 above)")
@click.option("--max-connections", type=click.IntRange(1), default=512, show_default=True,
              help="Open connections; one more closes the oldest idle or slow one, else answers 503 (lowered to "
                   "fit the open-file limit)")
@click.option("--max-concurrency", type=click.IntRange(1), default=16, show_default=True,
              help="Requests being scored at once (bodies being received do not count); one more answers 503")
@click.option("--max-uploads", type=click.IntRange(1), default=64, show_default=True,
              help="Request bodies being received at once; one more answers 503 (retry later)")
@click.option("--min-upload-kib-s", type=click.FloatRange(min=0, min_open=True), default=16.0, show_default=True,
              help="Slowest average rate of a request body after its first second; slower ones get 408")
@click.option("--max-buffered-mb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Request heads and bodies held in memory at once, all requests together; one that would go "
                   "over answers 503  [default: 4 x --max-body-mb]")
@click.option("--sync-threads", type=click.IntRange(1), default=16, show_default=True,
              help="Threads for --sync-in-thread calls; once all are stuck in calls past --timeout, requests get 503")
@click.option("--stalled-after-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="GET /health answers 503 'stalled' once a batch has been scoring this long  [default: --timeout]")
@click.option("--on-error", type=click.Choice(ON_ERROR), default="raise", show_default=True,
              help="A sample the reward fails on: HTTP 500 naming it (raise), score 0 (zero) or null (skip)")
@click.option("--timeout", "timeout_s", type=float, default=180.0, show_default=True,
              help="Seconds per call of an async or threaded reward function")
@click.option("--sync-in-thread", is_flag=True, help="Run sync functions in worker threads (timeouts apply)")
@click.option("--value-head-prefix", default="score", show_default=True,
              help="Score-head attribute of an OpenRLHF-layout reward model")
@click.option("--rm-batch-size", type=click.IntRange(1), default=8, show_default=True,
              help="Sequences per reward-model forward pass")
@click.option("--rm-device", default=None, help="Reward-model device (default: cuda when available)")
@click.option("--rm-dtype", default="auto", show_default=True, help="auto, float32, bfloat16 or float16")
@click.pass_obj
def serve_command(state: Any, spec: str, host: str, port: int, token_env: str | None, allow_no_token: bool,
                  max_body_mb: float, max_samples: int, max_depth: int, read_timeout_s: float,
                  head_timeout_s: float, max_head_kb: float, max_connections: int,
                  max_concurrency: int, max_uploads: int, min_upload_kib_s: float, max_buffered_mb: float | None,
                  sync_threads: int, stalled_after_s: float | None, on_error: str, timeout_s: float,
                  sync_in_thread: bool,
                  value_head_prefix: str, rm_batch_size: int, rm_device: str | None, rm_dtype: str) -> None:
    """Serve the reward SPEC over HTTP with OpenRLHF's protocol.

    SPEC is anything --reward accepts: a registered name, file.py[:func], module:attr, a reward
    model directory or another server's URL. POST {"query": [...], "prompts": [...], "labels":
    [...]} to any path (e.g. /get_reward); GET /health answers {"status": "ok"} (503 "stalled" while a
    batch runs past --stalled-after-s).

    \b
    rlhf reward serve my_rewards.py:accuracy --port 8000
    rlhf reward serve ./reward-model --host 0.0.0.0 --token-env RM_TOKEN
    """
    from rlhf.rewards.remote import read_token
    from rlhf.rewards.limits import ServerLimits
    from rlhf.rewards.server import RewardServer
    from rlhf.rewards import load_reward

    try:
        limits = ServerLimits(max_body_mb=max_body_mb, max_samples=max_samples, max_depth=max_depth,
                              read_timeout_s=read_timeout_s, head_timeout_s=head_timeout_s, max_head_kb=max_head_kb,
                              max_connections=max_connections, max_concurrency=max_concurrency, max_uploads=max_uploads,
                              min_upload_kib_s=min_upload_kib_s, max_buffered_mb=max_buffered_mb,
                              sync_threads=sync_threads, stalled_after_s=stalled_after_s or timeout_s)
    except ValueError as exc:
        raise click.UsageError(str(exc).replace("max_buffered_mb", "--max-buffered-mb")
                               .replace("max_body_mb", "--max-body-mb")) from None
    token = read_token(token_env, flag="--token-env")
    if not _is_loopback(host) and token is None and not allow_no_token:
        raise click.UsageError(f"refusing to serve on {host} without a token: anyone who can reach the port could "
                               "use it. Set --token-env VAR (clients send it with --reward-token-env VAR), bind "
                               "127.0.0.1, or pass --allow-no-token.")
    source = load_reward(spec, plugins=state.plugins, on_error=on_error, timeout_s=timeout_s,
                         sync_in_thread=sync_in_thread, value_head_prefix=value_head_prefix,
                         rm_batch_size=rm_batch_size, rm_device=rm_device, rm_dtype=rm_dtype)
    if not _is_loopback(host) and token is None:
        click.echo(f"Warning: serving on {host} without a token (--allow-no-token): anyone who can reach this "
                   "port can use it.", err=True)
    server = RewardServer(source, host=host, port=port, token=token, limits=limits, own_process=True)
    try:
        url = server.start()
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from None
    if server.max_connections < max_connections:
        click.echo(f"Warning: at most {server.max_connections} connections (--max-connections {max_connections}): "
                   "the open-file limit (ulimit -n) allows no more.", err=True)
    auth = "bearer token required" if token else "no token"
    click.echo(f"Serving reward {source.name!r} ({source.where}) on {url} (POST any path, GET /health; {auth}). "
               "Ctrl-C stops.", nl=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
