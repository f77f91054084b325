"""The plugin API: every name a plugin may import from rlhf, in one module, the stable contract.

    from rlhf.api import hookimpl, run_field, Trajectory

A plugin (the built-ins included) imports rlhf through this module only, besides ``rlhf.sandbox``
for running untrusted code and ``import rlhf; @rlhf.hookimpl`` (the same marker as
``rlhf.api.hookimpl``). Everything else of rlhf is the host's and may change in any release.
docs/plugins.md lists every name with what it is.

``API_VERSION`` is ``(major, minor)``. A minor release only adds: names, optional arguments,
registration flags; a plugin written against 1.0 works unchanged with every 1.x (one that needs
a later addition checks ``rlhf.api.API_VERSION >= (1, y)``). A major release may remove a name or
change what one means or takes: the only kind of release that can break a plugin.

Importing this module is light (no torch, no transformers, no fast path): each name is imported
from its home module on first use (`__getattr__`), so a plugin's registration module can import
``hookimpl`` from here and stay cheap for every ``rlhf`` command.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

API_VERSION = (1, 0)

# name -> its home module ("module", or "module:attr" where the api names it differently)
_HOMES: dict[str, str] = {
    # hooks
    "hookimpl": "rlhf.core.plugin_host.hookspecs",
    # protocols and their base classes
    "TrainBackend": "rlhf.core.protocols.backend",
    "TrainBackendBase": "rlhf.core.protocols.backend",
    "RolloutEngine": "rlhf.core.protocols.rollout",
    "ContinuousEngine": "rlhf.core.protocols.rollout",
    "Generation": "rlhf.core.protocols.rollout",
    "SamplingParams": "rlhf.core.protocols.rollout",
    "ModelAdapter": "rlhf.core.protocols.adapter",
    "ModelAdapterBase": "rlhf.core.protocols.adapter",
    "Objective": "rlhf.core.protocols.objective",
    "ObjectiveBase": "rlhf.core.protocols.objective",
    "FitModels": "rlhf.core.protocols.objective",
    "TextFormat": "rlhf.core.protocols.objective",
    "require": "rlhf.core.protocols.objective",
    "BadRow": "rlhf.core.protocols.objective",
    "SkipExample": "rlhf.core.protocols.objective",
    "Environment": "rlhf.core.protocols.environment",
    "Endpoint": "rlhf.core.protocols.agent",
    "AgentResult": "rlhf.core.protocols.agent",
    "AgentConfig": "rlhf.core.protocols.agent",
    "ParsedTurn": "rlhf.core.protocols.tool_parser",
    "tool_call": "rlhf.core.protocols.tool_parser",
    # data types
    "Trajectory": "rlhf.core.types",
    "StepResult": "rlhf.core.types",
    "RunInfo": "rlhf.core.types",
    "AdvantageConfig": "rlhf.core.types",
    "AdvantageInputs": "rlhf.core.types",
    "PolicyLossInputs": "rlhf.core.types",
    "LossNorm": "rlhf.core.types",
    "AlgorithmPreset": "rlhf.core.types",
    "RewardResult": "rlhf.core.rewards",
    # how a trajectory ended (docs/outcomes.md)
    "OUTCOMES": "rlhf.core.outcomes",
    "TRAINED": "rlhf.core.outcomes",
    "FAILURES": "rlhf.core.outcomes",
    "fail_trajectory": "rlhf.core.outcomes",
    "error_line": "rlhf.core.outcomes",
    "outcome_of_finish": "rlhf.core.outcomes",
    # settings
    "run_field": "rlhf.core.plugin_host.settings",
    # errors
    "RlhfError": "rlhf.core.errors",
    "ConfigError": "rlhf.core.errors",
    "says_no_space": "rlhf.core.errors",
    "no_space": "rlhf.core.errors",
    "size_text": "rlhf.core.errors",
    # verified weight syncs
    "WeightSyncError": "rlhf.core.weight_check",
    "WeightSyncTimeout": "rlhf.core.weight_check",
    "weight_checksum": "rlhf.core.weight_check:checksum",
    "add_checksums": "rlhf.core.weight_check:add",
    "sync_deadline": "rlhf.core.weight_check",
    # masked tensor math
    "as_float": "rlhf.core.masked",
    "masked": "rlhf.core.masked",
    "masked_sum": "rlhf.core.masked",
    "masked_mean": "rlhf.core.masked",
    # the offline objectives' math and batching helpers
    "sft_loss": "rlhf.objectives",
    "reward_model_loss": "rlhf.objectives",
    "dpo_loss": "rlhf.objectives",
    "kto_loss": "rlhf.objectives",
    "distillation_loss": "rlhf.objectives",
    "prm_loss": "rlhf.objectives",
    "prm_loss_at": "rlhf.objectives",
    "sequence_logprobs": "rlhf.objectives",
    "pad_right": "rlhf.objectives",
    "token_batch": "rlhf.objectives",
    "response_mask": "rlhf.objectives",
    "learnt_logprobs": "rlhf.objectives",
    "shared_learnt_logprobs": "rlhf.objectives",
    "last_token_scores": "rlhf.objectives",
    # log-probs
    "token_logprobs": "rlhf.core.logprobs",
    "without_last_token": "rlhf.core.logprobs",
    "DeferredHead": "rlhf.core.logprobs",
    "deferred_head": "rlhf.core.logprobs",
    "hidden_states_out": "rlhf.core.logprobs",
    # models and checkpoints
    "base_model": "rlhf.core.modeling",
    "innermost": "rlhf.core.modeling",
    "accepts_logits_to_keep": "rlhf.core.modeling",
    "cache_argument": "rlhf.core.modeling",
    "check_model_ref": "rlhf.core.modeling",
    "resolve_device": "rlhf.core.modeling",
    "reading_weights": "rlhf.core.modeling",
    "read_weight": "rlhf.core.checkpoints",
    "scalar_head_layout": "rlhf.core.checkpoints",
    # memory and processes
    "TrainStateOffload": "rlhf.core.offload",
    "TensorOffload": "rlhf.core.offload",
    "DistContext": "rlhf.core.distributed",
    "init_from_environment": "rlhf.core.distributed",
    # fast paths an engine or adapter may take
    "LeanDecoder": "rlhf.fastpaths.lean_decode",
    "LeanDecodeUnsupported": "rlhf.fastpaths.lean_decode",
    "lean_decoder_supported": "rlhf.fastpaths.lean_decode",
    "cache_tensors": "rlhf.fastpaths.llama_like",
    "fast_path_verdict": "rlhf.fastpaths.verdicts:verdict",
    "settle_fast_path": "rlhf.fastpaths.verdicts:settle",
    "check_cpu_linear_mode": "rlhf.fastpaths.cpu_linear:check_mode",
    "use_onednn_linears": "rlhf.fastpaths.cpu_linear",
    "use_vocab_chunks": "rlhf.fastpaths.vocab_chunks",
    "use_in_place_gradients": "rlhf.fastpaths.in_place_gradients",
    "accumulating_in_place": "rlhf.fastpaths.in_place_gradients",
    "in_place_capable": "rlhf.fastpaths.in_place_gradients",
    "is_packed": "rlhf.fastpaths.packing",
    "can_share": "rlhf.fastpaths.prefix_sharing",
    "checked_for_sharing": "rlhf.fastpaths.prefix_sharing",
    "share_prefixes": "rlhf.fastpaths.prefix_sharing",
    # testing a plugin
    "run_rlhf": "rlhf.plugin_kit.testing",
}

__all__ = ["API_VERSION", *_HOMES]


def __getattr__(name: str) -> Any:
    """Import ``name`` from its home module on first use (then it is a plain attribute)."""
    try:
        home = _HOMES[name]
    except KeyError:
        raise AttributeError(f"module 'rlhf.api' has no attribute {name!r}: the plugin API is rlhf.api.__all__ "
                             "(docs/plugins.md)") from None
    module, _, attr = home.partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # the same names for type checkers and editors (tests/core/test_api.py keeps them equal)
    from rlhf.core.checkpoints import read_weight, scalar_head_layout
    from rlhf.core.distributed import DistContext, init_from_environment
    from rlhf.core.errors import ConfigError, RlhfError, no_space, says_no_space, size_text
    from rlhf.core.logprobs import DeferredHead, deferred_head, hidden_states_out, token_logprobs, without_last_token
    from rlhf.core.masked import as_float, masked, masked_mean, masked_sum
    from rlhf.core.modeling import (accepts_logits_to_keep, base_model, cache_argument, check_model_ref, innermost,
                                    reading_weights, resolve_device)
    from rlhf.core.offload import TensorOffload, TrainStateOffload
    from rlhf.core.plugin_host.hookspecs import hookimpl
    from rlhf.core.plugin_host.settings import run_field
    from rlhf.core.protocols.adapter import ModelAdapter, ModelAdapterBase
    from rlhf.core.protocols.backend import TrainBackend, TrainBackendBase
    from rlhf.core.protocols.agent import AgentConfig, AgentResult, Endpoint
    from rlhf.core.protocols.environment import Environment
    from rlhf.core.protocols.objective import (BadRow, FitModels, Objective, ObjectiveBase, SkipExample, TextFormat,
                                               require)
    from rlhf.core.protocols.rollout import ContinuousEngine, Generation, RolloutEngine, SamplingParams
    from rlhf.core.protocols.tool_parser import ParsedTurn, tool_call
    from rlhf.core.outcomes import FAILURES, OUTCOMES, TRAINED, error_line, fail_trajectory, outcome_of_finish
    from rlhf.core.rewards import RewardResult
    from rlhf.core.types import (AdvantageConfig, AdvantageInputs, AlgorithmPreset, LossNorm, PolicyLossInputs,
                                 RunInfo, StepResult, Trajectory)
    from rlhf.core.weight_check import WeightSyncError, WeightSyncTimeout, sync_deadline
    from rlhf.core.weight_check import add as add_checksums
    from rlhf.core.weight_check import checksum as weight_checksum
    from rlhf.fastpaths.cpu_linear import check_mode as check_cpu_linear_mode
    from rlhf.fastpaths.cpu_linear import use_onednn_linears
    from rlhf.fastpaths.in_place_gradients import accumulating_in_place, in_place_capable, use_in_place_gradients
    from rlhf.fastpaths.lean_decode import LeanDecoder, LeanDecodeUnsupported, lean_decoder_supported
    from rlhf.fastpaths.llama_like import cache_tensors
    from rlhf.fastpaths.packing import is_packed
    from rlhf.fastpaths.prefix_sharing import can_share, checked_for_sharing, share_prefixes
    from rlhf.fastpaths.verdicts import settle as settle_fast_path
    from rlhf.fastpaths.verdicts import verdict as fast_path_verdict
    from rlhf.fastpaths.vocab_chunks import use_vocab_chunks
    from rlhf.objectives import (distillation_loss, dpo_loss, kto_loss, last_token_scores, learnt_logprobs, pad_right,
                                 prm_loss, prm_loss_at, response_mask, reward_model_loss, sequence_logprobs, sft_loss,
                                 shared_learnt_logprobs, token_batch)
    from rlhf.plugin_kit.testing import run_rlhf
