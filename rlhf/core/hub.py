"""Model options that name a local directory or a Hugging Face hub model (``org/name``).

``--model``, ``--critic-model``, ``--teacher`` and a reward model given to ``--reward`` each take
either. A hub name resolves through huggingface_hub as transformers resolves ``--model``: from the
local cache (all there is with ``HF_HUB_OFFLINE=1``), else downloaded. `check_model_option` says,
before any model loads, that a reference is neither (one `ConfigError` naming the flag and what
to pass instead); `hub_model_dir` is the local folder of a hub model (for code that reads files
itself, as the reward-model source does). `check_model_path` is the part that needs neither the
hub client nor the network: a reference that names no folder here and cannot be a hub name
(``./runs/sft/final``, ``a/b/c``), said before torch loads. huggingface_hub is imported inside functions.
"""

from __future__ import annotations

import re
from pathlib import Path

from rlhf.core.errors import ConfigError
from rlhf.core.modeling import check_hub_reachable

# the hub's repository ids: ``org/name`` (letters, digits, '-', '_', '.'; no '--' or '..' inside)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# what the hub client accepts as a model name: ``org/name``, or a bare ``name`` (the hub's oldest models)
_HUB_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*$")
_MARKS = ("config.json", "adapter_config.json")  # a model directory (a full model, or a PEFT adapter)
# what a model needs from its hub repository (not other weight formats: onnx, gguf, flax, ...)
_MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py"]


def is_hub_name(ref: str) -> bool:
    """``org/name`` that names nothing here: what the hub client would look up."""
    return (bool(_REPO_ID.match(ref)) and "--" not in ref and ".." not in ref and not ref.endswith(".py")
            and not Path(ref).expanduser().exists())


def check_model_path(ref: str, flag: str) -> None:
    """``ref`` names something here, or could be a hub model name; otherwise one `ConfigError`
    naming ``flag``. Reads only the file system (no hub client, no network, no torch): a hub name
    is left to `check_model_option` and the loaders, which may download it."""
    if Path(ref).expanduser().exists():
        return
    if _HUB_NAME.match(ref) and "--" not in ref and ".." not in ref and len(ref) <= 96:
        return
    raise ConfigError(f"{flag} {ref}: no such model directory, and not a hub model name (owner/name): check the "
                      "path, or pass a Hugging Face model directory (config.json and the weights) or a hub name like "
                      "owner/name")


def in_hub_cache(name: str) -> bool:
    """The hub model ``name`` is in the local cache (its config.json, at the revision ``main`` points to)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def check_model_option(ref: str, flag: str) -> None:
    """``ref`` is a local model directory or a hub model that can be had (cached; or, online, on
    the hub); otherwise one `ConfigError` saying what ``flag`` got and what to pass."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if not any((path / mark).is_file() for mark in _MARKS):
            raise ConfigError(f"{flag} {ref}: the directory has no config.json, so it is not a Hugging Face model")
        return
    if path.exists():
        raise ConfigError(f"{flag} {ref} is a file; pass a model directory (config.json and the weights) or a hub "
                          "name like org/name")
    if not is_hub_name(ref):
        raise ConfigError(f"{flag} {ref}: no such directory, and not a hub name (org/name): pass a local Hugging Face "
                          "model directory or a hub name like org/name")
    if in_hub_cache(ref):
        return
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{flag} {ref}: not a local directory, and the hub model {ref} is not in the Hugging Face "
                          f"cache ({constants.HF_HUB_CACHE}), the only place HF_HUB_OFFLINE=1 reads: download it "
                          f"first (hf download {ref}), unset HF_HUB_OFFLINE, or pass a local model directory")
    check_hub_reachable(ref)  # a moment's check, not the client's retries
    if not _exists_on_hub(ref):
        raise ConfigError(f"{flag} {ref}: no such model on the hub ({constants.ENDPOINT}) and no such local directory "
                          "(a private model needs HF_TOKEN)")


def _exists_on_hub(name: str) -> bool:
    """False only when the hub says there is no such repository (gated ones exist; other errors are
    left to the download, which reports them)."""
    from huggingface_hub import repo_exists

    try:
        return repo_exists(name)
    except Exception:  # noqa: BLE001 - the hub down, a proxy, ...: the download says more
        return True


def hub_model_dir(ref: str, flag: str) -> Path:
    """The local folder of the hub model ``ref``: the cached snapshot, downloaded first when online
    and missing (safetensors weights, or ``*.bin`` where the repository has none)."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(ref, allow_patterns=_MODEL_FILES))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(ref, allow_patterns=[*_MODEL_FILES, "*.bin"]))
    except Exception as exc:  # noqa: BLE001 - the client's errors (not found, offline, network) as one line
        check_model_option(ref, flag)  # the usual words where they apply
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{flag} {ref}: cannot get it from the hub: {detail}") from None
    return folder
