"""Policy weights for the ``vllm`` engine: names vLLM accepts, merged LoRA, bounded chunks, transport.

vLLM's models load weights with ``model.load_weights(iterable of (name, tensor))`` under the
names of the Hugging Face checkpoint (``model.layers.0.self_attn.q_proj.weight``); they fuse
q/k/v and gate/up themselves and shard for tensor parallelism. So a sync sends the policy's
weights under its checkpoint names:

* wrappers are stripped from names: DeepSpeed/DDP ``module.``, ``torch.compile``'s ``_orig_mod.``,
  peft's ``base_model.model.``, activation-checkpoint and FSDP wrapper segments;
* a peft LoRA layer is sent as one merged weight ``W + (α/r)·B A`` (peft's own
  ``get_delta_weight``, computed on the fly; the policy module is never modified), under the
  layer's name without ``base_layer``; adapter tensors (``lora_A``, ``lora_B``) are not sent;
* peft ``modules_to_save`` copies are sent under the wrapped module's name (the active copy);
* DeepSpeed ZeRO-3 parameters are gathered one module at a time (a collective: every rank
  of the policy must sync) and copied out before their partition is released;
* a model that transformers (5.x) holds in another layout than its checkpoint is sent in the
  checkpoint's (`checkpoint_layout`): a mixture-of-experts layer's experts, fused into
  ``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I), go out as one
  matrix per expert (Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, Qwen2-MoE's
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``), which is what vLLM's ``load_weights``
  maps onto its fused experts. The reversal is transformers' own, the one ``save_pretrained`` runs.

Tensors travel in buckets of bounded bytes (`bucket_by_bytes`), so a sync never holds more
than one bucket of merged or gathered copies. `send_weights`/`receive_weights` move the same
buckets over an already initialised ``torch.distributed`` group, for an engine in another
process than the trainer (not exercised on a GPU yet).

**Verification** (``verify_weight_sync``, on by default; `load_recorded`, `held_checksums`): while
vLLM's ``load_weights`` runs in its worker, every parameter's ``weight_loader`` is wrapped so that
each call records which vLLM parameter took which sent tensor, and the exact checksum
(``rlhf.api.weight_checksum``) of what it was given, cast to the parameter's dtype. Checksums are
order-free sums, so after the sync each vLLM parameter (a fused ``qkv_proj``, an MoE layer's
``experts.w13_weight``, a vocabulary padded with zeros) must hold exactly the sum of its parts'
checksums, and every sent tensor must have reached a loader. Both are exact (tolerance 0). With
tensor parallelism each worker holds a shard, so only the second part (every tensor reached a
loader) and the transport (what arrived equals what was sent) are checked.

Deviations: quantized policies (QLoRA's 4-bit base) are not mapped; DoRA adapters are refused;
LoRA adapters on fused expert tensors are not merged.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from rlhf.api import ConfigError, add_checksums, innermost, weight_checksum

Named = tuple[str, torch.Tensor]

_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")  # wrappers in front of the model's own names
_SEGMENTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "base_layer.")  # wrappers inside
_ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def vllm_weight_name(name: str) -> str | None:
    """The checkpoint name vLLM's ``load_weights`` expects for a policy parameter name, or None
    for a tensor that is not part of the checkpoint (an inactive ``modules_to_save`` original).

    ``module.base_model.model.model.layers.0.q_proj.base_layer.weight`` -> ``model.layers.0.q_proj.weight``.
    Raises ConfigError for LoRA adapter tensors: they have to be merged (`policy_weights`).
    """
    stripped = True
    while stripped:
        stripped = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    for segment in _SEGMENTS:
        name = name.replace(segment, "")
    parts = name.split(".")
    if any(part in _ADAPTER_PARTS for part in parts):
        raise ConfigError(f"{name!r} is a LoRA adapter tensor: vLLM needs merged weights. Let the engine read the "
                          "policy module (load_weights(None)), which merges W + (alpha/r) B A per layer")
    if "original_module" in parts:
        return None
    if "modules_to_save" in parts:  # X.modules_to_save.<adapter>.weight -> X.weight
        at = parts.index("modules_to_save")
        parts = parts[:at] + parts[at + 2:]
    return ".".join(parts)


def map_state_dict(state: dict[str, torch.Tensor], model: torch.nn.Module | None = None) -> Iterator[Named]:
    """``(vLLM name, tensor)`` for each entry of a state dict, in its order; in the checkpoint
    layout of ``model`` (the module the state dict belongs to) when given (`checkpoint_layout`)."""
    named = ((vllm_weight_name(name), tensor.detach()) for name, tensor in state.items())
    named = ((name, tensor) for name, tensor in named if name is not None)
    return checkpoint_layout(model, named) if model is not None else named


def policy_weights(model: torch.nn.Module) -> Iterator[Named]:
    """``(vLLM name, tensor)`` for every weight of the policy module, LoRA layers merged, each
    parameter once (tied weights: the first name, like ``named_parameters``), in module order,
    in the checkpoint's layout (`checkpoint_layout`)."""
    named = ((vllm_weight_name(name), tensor) for name, tensor in _walk(model, "", set()))
    return checkpoint_layout(model, ((name, tensor) for name, tensor in named if name is not None))


def checkpoint_layout(model: torch.nn.Module, named: Iterable[Named]) -> Iterator[Named]:
    """``named`` (checkpoint names of ``model``'s tensors, a module's tensors together) as its
    checkpoint holds them. transformers 5 loads some checkpoints into another layout (a MoE
    layer's experts fused into 3D tensors, Mixtral's ``block_sparse_moe`` renamed ``mlp``) and
    ``save_pretrained`` reverts it; so does this, one module's tensors at a time. Models that
    keep their checkpoint's layout (and every model under transformers 4) pass unchanged."""
    revert = _layout_reverter(innermost(model))
    if revert is None:
        yield from named
        return
    for _, group in itertools.groupby(named, key=lambda item: item[0].rpartition(".")[0]):
        yield from revert(dict(group)).items()


def _layout_reverter(model: Any) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
    """transformers' ``revert_weight_conversion`` for ``model``, or None when it converts nothing."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, revert_weight_conversion
    except ImportError:  # transformers 4: modules are laid out as their checkpoints
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # built, not loaded: transformers' default conversions of the model type
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    if not conversions:
        return None
    return lambda state: revert_weight_conversion(model, state)


def _walk(module: torch.nn.Module, prefix: str, seen: set[int]) -> Iterator[Named]:
    if _is_lora_layer(module):
        yield from _merged_lora(module, prefix, seen)
        return
    if _is_modules_to_save(module):
        yield from _walk(_active_copy(module), prefix, seen)
        return
    own = [(name, p) for name, p in module.named_parameters(recurse=False) if id(p) not in seen]
    seen.update(id(p) for _, p in own)
    with _gathered([p for _, p in own]) as gathered:  # ZeRO-3: copied out before the partition returns
        tensors = [(prefix + name, p.detach().clone() if gathered else p.detach()) for name, p in own]
    yield from tensors
    for name, child in module.named_children():
        yield from _walk(child, f"{prefix}{name}.", seen)


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")


def _is_modules_to_save(module: torch.nn.Module) -> bool:
    return hasattr(module, "original_module") and hasattr(module, "modules_to_save")


def _active_copy(wrapper: Any) -> torch.nn.Module:
    if getattr(wrapper, "disable_adapters", False):
        return wrapper.original_module
    active = wrapper.active_adapters if hasattr(wrapper, "active_adapters") else [wrapper.active_adapter]
    active = [active] if isinstance(active, str) else list(active)
    return wrapper.modules_to_save[active[0]] if active and active[0] in wrapper.modules_to_save \
        else wrapper.original_module


def _merged_lora(layer: Any, prefix: str, seen: set[int]) -> Iterator[Named]:
    """The layer's base weight plus each active adapter's (α/r)·B A, and its bias, under ``prefix``."""
    if any(getattr(layer, "use_dora", {}).get(a, False) for a in layer.lora_A.keys()):
        raise ConfigError("DoRA adapters cannot be merged for the vllm engine yet; use plain LoRA")
    base = layer.base_layer
    seen.update(id(p) for p in layer.parameters())
    with _gathered(list(layer.parameters())), torch.no_grad():
        weight = base.weight.detach().to(torch.float32, copy=True)  # (out, in) a copy: the policy is not modified
        if not getattr(layer, "merged", False) and not getattr(layer, "disable_adapters", False):
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A.keys() or adapter in getattr(layer, "lora_embedding_A", {}):
                    weight += layer.get_delta_weight(adapter).float()  # (out, in) (α/r)·B A
        weight = weight.to(base.weight.dtype)  # one rounding of W + ΔW
        bias = base.bias.detach().clone() if getattr(base, "bias", None) is not None else None
    yield prefix + "weight", weight
    if bias is not None:
        yield prefix + "bias", bias


@contextlib.contextmanager
def _gathered(params: list[torch.nn.Parameter]) -> Iterator[bool]:
    """Full values of ZeRO-3 partitioned parameters inside the block (yields True then); else nothing to do."""
    if not any(hasattr(p, "ds_id") for p in params):
        yield False
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield True


def policy_version(model: torch.nn.Module) -> tuple[int, ...]:
    """Changes whenever a parameter is modified in place (optimizer step, ``load_state_dict``):
    torch counts in-place writes per tensor, views included."""
    return tuple(p._version for p in model.parameters())


def bucket_by_bytes(named: Iterable[Named], max_bytes: int) -> Iterator[list[Named]]:
    """Consecutive chunks of ``named``, in order, each at most ``max_bytes`` (a larger tensor alone).

    Consumes ``named`` lazily, so merged or gathered copies exist for one bucket at a time.
    """
    assert max_bytes > 0, f"max_bytes must be positive, got {max_bytes}"
    bucket: list[Named] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


# --- across processes: an already initialised torch.distributed group ----------------------


def send_weights(named: Iterable[Named], *, group: Any, src: int, max_bytes: int, verify: bool = True) -> int:
    """Broadcast ``named`` from rank ``src`` of ``group`` bucket by bucket (the receivers run
    `receive_weights`); returns the bytes sent. Tensors must be on the group's device (CUDA for NCCL).
    ``verify``: the end message carries each sent tensor's checksum, for the receiver to compare."""
    import torch.distributed as dist

    sent = 0
    checksums: dict[str, Any] = {}
    for bucket in bucket_by_bytes(named, max_bytes):
        header = [[(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]]
        dist.broadcast_object_list(header, src=src, group=group)
        for name, tensor in bucket:
            dist.broadcast(tensor.contiguous(), src=src, group=group)
            sent += tensor.numel() * tensor.element_size()
            if verify:
                checksums[name] = weight_checksum(tensor)
    dist.broadcast_object_list([{"checksums": checksums} if verify else None], src=src, group=group)  # the end
    return sent


def receive_weights(*, group: Any, src: int, device: torch.device | str,
                    sent_checksums: dict[str, Any] | None = None) -> Iterator[list[Named]]:
    """The buckets `send_weights` broadcasts from rank ``src``, received into tensors on ``device``.
    ``sent_checksums``: filled at the end with the sender's checksums (when it sent them)."""
    import torch.distributed as dist

    while True:
        header: list[Any] = [None]
        dist.broadcast_object_list(header, src=src, group=group)
        if header[0] is None or isinstance(header[0], dict):  # the end
            if sent_checksums is not None and header[0] is not None:
                sent_checksums.update(header[0]["checksums"])
            return
        bucket = []
        for name, shape, dtype in header[0]:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.broadcast(tensor, src=src, group=group)
            bucket.append((name, tensor))
        yield bucket


# --- verification, inside vLLM's worker (tests/vllm/fakes.py stands in for vLLM there) ---------------


def load_recorded(model: Any, weights: list[Named], default_loader: Callable[..., Any], *,
                  params_too: bool = True) -> dict[str, Any]:
    """``model.load_weights(weights)`` with every parameter's ``weight_loader`` recording its calls.

    Returns ``{"into": {vLLM parameter: [sent names]}, "sums": {vLLM parameter: checksum of what its
    loaders were given, in its dtype}, "held": {vLLM parameter: its checksum after loading},
    "reached": [sent names that reached a loader], "arrived": {sent name: checksum}}`` (``params_too``
    False, for a worker that holds a shard: ``arrived`` instead of ``sums`` and ``held``). A call is
    attributed to the sent tensor whose memory it was given (a view of it included), else to the
    tensor ``load_weights`` read last. ``default_loader``: what vLLM calls for a parameter without one.
    """
    by_memory = {(t.data_ptr(), tuple(t.shape)): name for name, t in weights}
    by_pointer = {t.data_ptr(): name for name, t in weights}
    current: list[str | None] = [None]
    into: dict[str, list[str]] = {}
    sums: dict[str, Any] = {}
    patched: list[tuple[Any, str, Any, bool]] = []

    def recording(param_name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def weight_loader(param: Any, loaded: Any, *args: Any, **kwargs: Any) -> Any:
            sent = by_memory.get((loaded.data_ptr(), tuple(loaded.shape))) or by_pointer.get(loaded.data_ptr()) \
                or current[0]
            into.setdefault(param_name, []).append(sent)
            if params_too:
                part = weight_checksum(loaded.to(param.dtype))
                sums[param_name] = add_checksums(sums[param_name], part) if param_name in sums else part
            return original(param, loaded, *args, **kwargs)
        return weight_loader

    def read() -> Iterator[Named]:
        for name, tensor in weights:
            current[0] = name
            yield name, tensor

    try:
        for name, param in model.named_parameters():
            attribute = "weight_loader"
            had = attribute in vars(param)
            original = getattr(param, attribute, None)
            try:
                setattr(param, attribute, recording(name, original or default_loader))
            except AttributeError:  # vLLM's parameter classes expose the loader as a read-only property
                attribute, had, original = "_weight_loader", True, param._weight_loader
                param._weight_loader = recording(name, original)
            patched.append((param, attribute, original, had))
        model.load_weights(read())
    finally:
        for param, attribute, original, had in patched:
            if had:
                setattr(param, attribute, original)
            else:
                delattr(param, attribute)
    reached = sorted({name for names in into.values() for name in names if name is not None})
    arrived = {name: weight_checksum(tensor) for name, tensor in weights} if not params_too else {}
    held = held_checksums(model, into) if params_too else {}
    return {"into": into, "sums": sums, "held": held, "reached": reached, "arrived": arrived, "whole": params_too}


def held_checksums(model: Any, names: Iterable[str]) -> dict[str, Any]:
    """The checksums of the vLLM parameters ``names`` as the model holds them now."""
    wanted = set(names)
    return {name: weight_checksum(param) for name, param in model.named_parameters() if name in wanted}


def verify_records(sent: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """What went wrong in one sync, one phrase per problem (empty: the engine holds what was sent).

    ``sent``: sent name -> checksum (computed by the engine before it sent; None where unused);
    ``records``: what `load_recorded` returned for each bucket, in order, from one worker. A
    parameter is compared as the last bucket that wrote it left it (no later bucket touched it, so
    every part of it had arrived), with the sum of what every bucket loaded into it. A worker that
    holds a shard compares what arrived with what was sent instead."""
    problems = []
    held: dict[str, Any] | None = {} if all(record["whole"] for record in records) else None
    for record in records if held is not None else ():
        held.update(record["held"])
    reached = {name for record in records for name in record["reached"]}
    for name in sent:
        if name not in reached:
            problems.append(f"{name} was sent but vLLM's load_weights never loaded it into a parameter")
    if held is None:
        arrived = {name: value for record in records for name, value in record["arrived"].items()}
        for name, value in sent.items():
            if name in arrived and tuple(arrived[name]) != tuple(value):
                problems.append(f"{name} arrived with other values than were sent")
        return problems
    into: dict[str, list[str]] = {}
    expected: dict[str, Any] = {}
    for record in records:
        for param, names in record["into"].items():
            into.setdefault(param, []).extend(names)
            part = record["sums"][param]
            expected[param] = add_checksums(expected[param], part) if param in expected else part
    for param, value in expected.items():
        if tuple(held.get(param, ())) != tuple(value):
            names = ", ".join(dict.fromkeys(n for n in into[param] if n is not None))
            problems.append(f"{names} (held in vLLM's {param}) holds other values than were loaded into it")
    return problems

