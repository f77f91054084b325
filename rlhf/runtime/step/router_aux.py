"""``--aux-loss-coef C``: the router load-balancing loss of a mixture-of-experts model, added to
the training loss of the trained model (the fit loop's model, the RL policy) with coefficient C.

The loss is transformers' own (``load_balancing_loss_func`` of the model's modeling module, the
value its causal LMs return as ``aux_loss`` when called with ``output_router_logits=True``):
E · Σ_e f_e · P_e, with f_e the fraction of the forward's real tokens (every layer's routing
pooled) sent to expert e and P_e their mean router probability for e. Real tokens are those of
the forward's 2D ``attention_mask``; a packed row has no padding, so all of its tokens.

`RouterAux.attach(model, ...)` finds the transformers base model inside ``model`` (the causal LM's
``.model``; under DeepSpeed, PEFT or a value head's wrapper) and hooks its forward; the loss is
computed from that forward's router logits and attention mask by the function the causal LM
itself calls. Within `RouterAux.added`, every forward that runs with gradients enabled is asked
for its router logits and its load-balancing loss is kept; forwards without gradients (the
reference, the no-grad statistics passes, the fast paths' checks, eval) are left alone.
Objectives and the policy loss need not know about it.

How the parts combine:

* a micro-batch whose loss ran several grad-enabled forwards takes their mean, weighted by each
  forward's real tokens (DPO's chosen and rejected run as one forward: one value);
* the micro-batch's ``C · aux`` joins its loss before the loop scales the loss by the
  micro-batch's share of the step (units in the fit loop, loss tokens in RL), so the step adds
  ``C`` times the share-weighted mean of the micro-batches' aux losses, as it does their losses.
  The aux loss of a micro-batch is not the mean of its tokens' (it is a product of two means),
  so its value depends on how the step is cut into micro-batches, as in transformers' own
  training with gradient accumulation;
* metric ``aux_loss`` (``train/aux_loss``, ``policy/aux_loss``): that weighted mean, without C.

Shape legend: ``B`` rows, ``T`` tokens, ``E`` experts, ``N`` routed tokens (``B · T``).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rlhf.core.errors import ConfigError, RlhfError
from rlhf.core.modeling import innermost


class RouterAux:
    """The router load-balancing loss of ``module``'s grad-enabled forwards (see the module doc)."""

    def __init__(self, module: torch.nn.Module, coef: float):
        self.module, self.coef = module, coef
        self._kept: list[tuple[torch.Tensor, float]] | None = None  # (aux loss, real tokens) per forward
        self._signature = inspect.signature(module.forward)
        module.register_forward_pre_hook(self._before, with_kwargs=True)
        module.register_forward_hook(self._after, with_kwargs=True)

    @classmethod
    def attach(cls, model: torch.nn.Module, coef: float, name: str) -> RouterAux | None:
        """``--aux-loss-coef coef`` on ``model`` (loaded from ``name``): None when ``coef`` is 0; a
        usage error when the model routes nothing (not a mixture of experts)."""
        if not coef:
            return None
        module = router_module(model)
        if module is None:
            raise not_an_moe(coef, name, type(innermost(model)).__name__)
        return cls(module, coef)

    def added(self, compute: Callable[[], tuple[torch.Tensor, dict[str, Any]]],
              share: float = 1.0) -> tuple[torch.Tensor, dict[str, Any]]:
        """``compute()`` -> ``(loss, metrics)``, with ``C · share · aux`` added to the loss and
        ``aux_loss`` (the forwards' token-weighted mean) to the metrics. ``share``: the micro-batch's
        share of the step when ``compute``'s loss is already scaled by it (RL), 1 when the caller
        scales after (the fit loop)."""
        with self._keeping() as kept:
            loss, metrics = compute()
        if not kept:
            raise RlhfError(f"--aux-loss-coef: the training forward of {type(self.module).__name__} did not run "
                            "under gradients, so no router logits came back; report this as a bug")
        tokens = sum(count for _, count in kept)
        aux = sum(value * (count / tokens) for value, count in kept) if tokens > 0 else kept[0][0] * 0.0
        return loss + (self.coef * share) * aux.to(loss.device), {**metrics, "aux_loss": float(aux.detach())}

    @contextlib.contextmanager
    def _keeping(self) -> Iterator[list[tuple[torch.Tensor, float]]]:
        self._kept = kept = []
        try:
            yield kept
        finally:
            self._kept = None

    def _active(self) -> bool:
        return self._kept is not None and torch.is_grad_enabled()

    def _before(self, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self._active():
            return None
        return args, {**kwargs, "output_router_logits": True}

    def _after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not self._active():
            return
        bound = self._signature.bind_partial(*args, **kwargs)
        mask = bound.arguments.get("attention_mask")  # (B, T) or None
        input_ids = bound.arguments.get("input_ids")  # (B, T)
        if mask is not None and mask.dim() != 2:
            raise RlhfError(f"--aux-loss-coef: {type(module).__name__} was run with a {mask.dim()}D attention mask; the "
                            "load-balancing loss needs the (B, T) mask of real tokens (a fast path that builds its "
                            "own mask must step aside)")
        aux = balancing_loss(module, output.router_logits, mask)  # what the causal LM returns as aux_loss
        tokens = float(mask.sum()) if mask is not None else float(input_ids.numel() if input_ids is not None else 1)
        self._kept.append((aux, tokens))


def check_routes(coef: float, ref: str, *, trust_remote_code: bool = False) -> None:
    """Before any model loads: ``--aux-loss-coef coef`` > 0 with a local model directory whose config
    has no router (``output_router_logits``) is a usage error. Other references (hub names, adapter
    directories) are checked when the model loads (`RouterAux.attach`)."""
    if not coef or not (Path(ref).expanduser() / "config.json").is_file():
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(Path(ref).expanduser(), trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - loading the model reports what is wrong with it
        return
    if not hasattr(config, "output_router_logits"):
        raise not_an_moe(coef, ref, (getattr(config, "architectures", None) or [config.model_type])[0])


def not_an_moe(coef: float, name: str, kind: str) -> ConfigError:
    return ConfigError(f"--aux-loss-coef {coef}: {name} ({kind}) is not a mixture-of-experts model (it has no router "
                       "whose logits could be returned); drop --aux-loss-coef, or train an MoE model such as "
                       "Mixtral or Qwen2-MoE")


def router_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The transformers base model inside ``model`` that returns router logits when asked (its config
    has ``output_router_logits``): a causal LM's ``.model`` (called as a module by the causal LM's
    forward, also under PEFT, which calls the causal LM's ``forward`` directly), or the backbone
    under a value head."""
    from transformers import PreTrainedModel

    for module in innermost(model).modules():
        if isinstance(module, PreTrainedModel) and hasattr(module.config, "output_router_logits"):
            return module.base_model
    return None


def balancing_loss(module: torch.nn.Module, router_logits: tuple[torch.Tensor, ...],
                   mask: torch.Tensor | None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` of ``module``'s modeling module, on the router logits
    ((N, E) per layer) of a forward with (B, T) ``mask`` (None: every token is real)."""
    function = getattr(sys.modules[type(module).__module__], "load_balancing_loss_func", None)
    config = module.config
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if function is None or experts is None or top_k is None:
        raise RlhfError(f"--aux-loss-coef: {type(module).__name__}'s modeling module has no load_balancing_loss_func "
                        "(or its config no expert counts); train the causal LM, or drop --aux-loss-coef")
    return function(router_logits, experts, top_k, mask)
