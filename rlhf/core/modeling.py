"""Small facts about transformers models that the runtime and plugins both need. No torch at import.

* `base_model`: the transformers model inside a PEFT wrapper (or the model itself). PEFT's
  forward passes keyword arguments through, but its signature hides the inner model's.
* `innermost`: the model under training wrappers (DeepSpeed, DDP) and PEFT's.
* `accepts_logits_to_keep`: whether a model class's forward takes ``logits_to_keep`` (project
  only the last positions to the vocabulary), cached per class.
* `check_model_ref`: a model reference written as a path names a model directory (one line
  instead of the hub's traceback).
* `resolve_device`: ``--device`` as a torch device (``auto``: cuda when available), refused in
  one line when it names no device type or a GPU this torch cannot use.
* `cache_argument`: the name a model class's forward takes its KV cache by (``cache`` from
  transformers 5.2x, which deprecates ``past_key_values``; ``past_key_values`` before).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError, RlhfError


def base_model(model: Any) -> Any:
    """The model a PEFT wrapper holds, or ``model`` when it is not wrapped."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@lru_cache(maxsize=None)
def accepts_logits_to_keep(forward_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(forward_cls.forward).parameters


@lru_cache(maxsize=None)
def cache_argument(forward_cls: type) -> str:
    return "cache" if "cache" in inspect.signature(forward_cls.forward).parameters else "past_key_values"


def innermost(model: Any) -> Any:
    """The model under training wrappers (DeepSpeed's engine, DDP: ``.module``) and PEFT's wrapper."""
    import torch

    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return base_model(model)


def check_model_ref(ref: str, *, weights: bool = True) -> None:
    """A reference written as a path (``/``, ``./``, ``../``, ``~``, or more than one ``/``) must be a
    directory; otherwise transformers tries it as a hub name and fails with a long traceback."""
    looks_like_path = ref.startswith(("/", "./", "../", "~", ".\\")) or ref.count("/") > 1 or ref in (".", "..")
    path = Path(ref).expanduser()
    if looks_like_path and not path.exists():
        raise ConfigError(f"{ref}: no such model directory (a model is a local Hugging Face directory with "
                          "config.json, or a hub name like org/name)")
    if path.is_file():
        raise ConfigError(f"{ref} is a file; a model is a directory with config.json and the weights")
    marks = ("config.json", "adapter_config.json") if weights else ("config.json", "tokenizer_config.json",
                                                                      "tokenizer.json")
    if path.is_dir() and not any((path / mark).is_file() for mark in marks):
        raise ConfigError(f"{ref} has no {' or '.join(marks)}: it is not a Hugging Face "
                          f"{'model' if weights else 'model or tokenizer'} directory")
    if not path.exists():
        check_hub_reachable(ref)


_DAMAGED_TYPES = ("SafetensorError", "HeaderTooLarge", "UnpicklingError", "EOFError")
_DAMAGED_WORDS = ("PytorchStreamReader", "central directory", "unexpected EOF", "not fully covered",
                  "incomplete metadata")


@contextlib.contextmanager
def reading_weights(ref: str) -> Iterator[None]:
    """A damaged or incomplete weights file met while loading ``ref`` as one `RlhfError` naming the
    model, instead of the reader's traceback (safetensors, torch's zip reader, pickle)."""
    try:
        yield
    except Exception as exc:
        damaged = type(exc).__name__ in _DAMAGED_TYPES or (
            isinstance(exc, (RuntimeError, OSError, ValueError)) and any(w in str(exc) for w in _DAMAGED_WORDS))
        if not damaged:
            raise
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RlhfError(f"cannot read the weights of {ref}: a file there is damaged or incomplete ({detail}); "
                        "copy or download it again") from exc


def check_hub_reachable(name: str) -> None:
    """A hub name with the hub out of reach fails in a moment, not after the hub client's retries
    (about 50 s): with a cached copy, say how to use it; without, say what to pass instead. One TCP
    connection to the hub's host, once per process; skipped in offline mode (``HF_HUB_OFFLINE=1``:
    the client reads the cache only) and behind a proxy (the proxy decides what is reachable)."""
    import os

    from huggingface_hub import constants, try_to_load_from_cache

    proxied = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if constants.HF_HUB_OFFLINE or proxied or _reachable(constants.ENDPOINT):
        return
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise ConfigError(f"{name}: the hub ({constants.ENDPOINT}) cannot be reached and a copy is in the local "
                          "cache: run with HF_HUB_OFFLINE=1 to use it")
    raise ConfigError(f"{name}: the hub ({constants.ENDPOINT}) cannot be reached to download it and it is not in "
                      "the local cache: pass a local model directory, or connect and retry")


@lru_cache(maxsize=None)
def _reachable(endpoint: str, timeout: float = 3.0) -> bool:
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    try:
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_device(device: str | None, *, flag: str = "--device") -> Any:
    """``auto`` (or None): cuda when available, else cpu; ``cpu``, ``cuda``, ``cuda:N``, ... checked:
    a name torch does not know, or a CUDA device this torch has not (a CPU-only build, no GPU, an
    index past the last GPU) is a `ConfigError` naming ``flag``."""
    import torch

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{flag} {device}: not a device; use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU is visible"
            raise ConfigError(f"{flag} {device}: {why}; use --device cpu (or auto)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ConfigError(f"{flag} {device}: there are {torch.cuda.device_count()} GPU(s) (cuda:0 to "
                              f"cuda:{torch.cuda.device_count() - 1})")
    return resolved
