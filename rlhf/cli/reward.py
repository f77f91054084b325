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
              help="Address to bind; anything but loopback should come with --token-env")
@click.option("--port", default=5000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to bind (0: any free port, printed at start)")
@click.option("--token-env", metavar="VAR", default=None,
              help="Require 'Authorization: Bearer $VAR' on every request (default: RLHF_REWARD_TOKEN when set)")
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
def serve_command(state: Any, spec: str, host: str, port: int, token_env: str | None, on_error: str,
                  timeout_s: float, sync_in_thread: bool, value_head_prefix: str, rm_batch_size: int,
                  rm_device: str | None, rm_dtype: str) -> None:
    """Serve the reward SPEC over HTTP with OpenRLHF's protocol.

    SPEC is anything --reward accepts: a registered name, file.py[:func], module:attr, a reward
    model directory or another server's URL. POST {"query": [...], "prompts": [...], "labels":
    [...]} to any path (e.g. /get_reward); GET /health answers {"status": "ok"}.

    \b
    rlhf reward serve my_rewards.py:accuracy --port 8000
    rlhf reward serve ./reward-model --host 0.0.0.0 --token-env RM_TOKEN
    """
    from rlhf.rewards.remote import read_token
    from rlhf.rewards.server import RewardServer
    from rlhf.rewards import load_reward

    token = read_token(token_env, flag="--token-env")
    source = load_reward(spec, plugins=state.plugins, on_error=on_error, timeout_s=timeout_s,
                         sync_in_thread=sync_in_thread, value_head_prefix=value_head_prefix,
                         rm_batch_size=rm_batch_size, rm_device=rm_device, rm_dtype=rm_dtype)
    if not _is_loopback(host) and token is None:
        click.echo(f"Warning: serving on {host} without a token: anyone who can reach this port can use it. "
                   "Set --token-env VAR (clients send the same token with --reward-token-env VAR).", err=True)
    server = RewardServer(source, host=host, port=port, token=token)
    try:
        url = server.start()
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from None
    auth = "bearer token required" if token else "no token"
    click.echo(f"Serving reward {source.name!r} ({source.where}) on {url} (POST any path, GET /health; {auth}). "
               "Ctrl-C stops.", nl=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
