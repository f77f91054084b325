"""The ``vllm`` rollout engine: sampling with vLLM in the training process, weights pushed after each step.

Install with ``pip install "rlhf-core[vllm]"`` on a machine with a CUDA GPU; select with
``--engine vllm``. Nothing here imports vLLM until an engine is built.

* **The distribution.** What `SamplingParams` states, as the ``hf`` engine samples it: the
  repetition penalty (vLLM's, on prompt and output tokens), temperature, top-k, top-p, nothing
  else (min-p and the other penalties off; the checkpoint's ``generation_config.json`` is ignored,
  ``generation_config="vllm"``). EOS is the policy's ``generation_config.eos_token_id`` (else the
  tokenizer's), as the ``hf`` engine decides it, passed as stop token ids with ``ignore_eos``.
  Greedy when the temperature is 0.
* **Log-probs.** ``logprobs_mode="processed_logprobs"``: the log-prob of each sampled token under
  the distribution it was sampled from, i.e. ``log softmax(z / τ)`` renormalised over the top-p
  nucleus (vLLM >= 0.10.2; 0.10.0 reported them before the temperature). At ``top_p = 1``
  this is the trainer's ``log softmax(z / τ)`` (rlhf/core/logprobs.py) up to numerics; with
  top-p it is the nucleus-renormalised value the ``hf`` engine reports too. Greedy: log softmax
  of the raw logits. This mode turns off vLLM's FlashInfer top-p sampler (PyTorch's is used).
* **Layout.** Each prompt is sent ``n`` times (rows ``[p0s0 .. p0s(n-1), p1s0, ...]``; prefix
  caching shares the prompt's KV cache); prompts go in as token ids.
* **Weights** (`load_weights`): the policy module's weights under checkpoint names (LoRA merged;
  rlhf/plugins/engines/vllm_weights.py), in buckets of ``sync_bucket_mb``, loaded into vLLM's
  model in this process through ``collective_rpc``; then the prefix cache is reset (cached
  keys/values belong to the old weights). ``last_sync_seconds``/``last_sync_bytes`` record the
  last sync. Every sync is verified (``verify_weight_sync``, ``--verify-weight-sync``, on by
  default): vLLM's parameters must hold exactly what their loaders were given and every sent
  tensor must have reached one (exact checksums; rlhf/plugins/engines/vllm_weights.py), else
  `WeightSyncError` names the tensor and the run stops; a sync running past
  ``weight_sync_timeout_s`` (``--weight-sync-timeout-s``) raises `WeightSyncTimeout`
  (``rlhf.api.sync_deadline``). Before a generation the engine also pushes the weights itself when the policy's
  parameters changed since the last sync (torch's in-place write counters), so a resumed run or
  a caller that forgets to sync never samples from stale weights.
* **Sleep** (``enable_sleep_mode``): `sleep` frees the GPU memory vLLM holds (level 1: weights to
  CPU, KV cache dropped; level 2: both dropped) and `wake_up` takes it back; ``auto_sleep``
  sleeps after every generation and wakes for the next sync or generation.
* **Continuous batching** (`generate_one`, what a rollout uses when the engine offers it): each
  call adds one request to the ``LLM`` object's own engine and an asyncio task steps that engine
  while requests are in flight (rlhf/plugins/engines/vllm_continuous.py says why not
  ``AsyncLLM``), so a trajectory's next turn joins the running batch as soon as it is asked
  for. Same sampling arguments as `generate`, plus ``params.seed`` as vLLM's per-request seed.
  Before a request joins: wake, and push the weights if the policy changed (after the requests
  in flight have ended, so that no request mixes two weight versions and the prefix-cache reset
  is not refused). ``auto_sleep`` sleeps when the last request in flight has ended.

Version-specific calls (vLLM 0.10.2-0.33, read from their sources) live in `build_llm`,
`final_only`, `_load_into_worker` and vllm_continuous.py (``llm_engine``'s request API).
Deviations: one engine per process (no data-parallel ranks sharing a process group with vLLM),
dense unquantized models; tensor parallelism > 1 sends the weights through vLLM's worker RPC
(pickled, slower) and is unverified.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
import itertools
import logging
import os
import random
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rlhf.api import ConfigError, Generation, SamplingParams, WeightSyncError, sync_deadline, weight_checksum
from rlhf.plugins.engines.config import VLLMEngineConfig
from rlhf.plugins.engines.vllm_continuous import RequestBatch
from rlhf.plugins.engines.vllm_weights import (Named, bucket_by_bytes, load_recorded,
                                               map_state_dict, policy_version, policy_weights, receive_weights,
                                               verify_records)

log = logging.getLogger(__name__)

MIN_VERSION = "0.10.2"  # processed log-probs include the temperature from this release on
BELOW_VERSION = "0.34"  # the newest release whose API was read is 0.33.0
SUPPORTED = f"vllm>={MIN_VERSION},<{BELOW_VERSION}"
SKIP_VERSION_CHECK = "RLHF_VLLM_SKIP_VERSION_CHECK"
WAKE_TAGS = ("weights", "kv_cache")  # wake order: a level-2 sleep restores buffers into the weights
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


class VLLMSetupError(ConfigError):
    """vLLM cannot run here: not installed, an unsupported version, no CUDA GPU, or several ranks."""


def validate(config: VLLMEngineConfig) -> None:
    problems = []
    if config.dtype != "auto" and config.dtype not in DTYPES:
        problems.append(f"dtype must be auto or one of {', '.join(DTYPES)}, got {config.dtype!r}")
    if config.tensor_parallel_size < 1:
        problems.append(f"tensor_parallel_size must be at least 1, got {config.tensor_parallel_size}")
    if not 0.0 < config.gpu_memory_utilization <= 1.0:
        problems.append(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}")
    if config.sleep_level not in (1, 2):
        problems.append(f"sleep_level must be 1 or 2, got {config.sleep_level}")
    if config.auto_sleep and not config.enable_sleep_mode:
        problems.append("auto_sleep needs enable_sleep_mode")
    if config.sync_bucket_mb <= 0:
        problems.append(f"sync_bucket_mb must be positive, got {config.sync_bucket_mb}")
    if problems:
        raise ConfigError("vllm engine: " + "; ".join(problems))


# --- can vLLM run here? ----------------------------------------------------------------------


def require_vllm() -> Any:
    """The ``vllm`` module, after checking that a supported release is installed."""
    try:
        installed = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise VLLMSetupError('--engine vllm needs vLLM, which is not installed. Install it on a machine with a '
                             'CUDA GPU: pip install "rlhf-core[vllm]" (or --engine hf)') from None
    check_version(installed)
    import vllm

    return vllm


def check_version(installed: str) -> None:
    from packaging.version import InvalidVersion, Version

    if os.environ.get(SKIP_VERSION_CHECK) == "1":
        return
    try:
        release = Version(Version(installed).base_version)
    except InvalidVersion:
        release = None
    if release is None or not Version(MIN_VERSION) <= release < Version(BELOW_VERSION):
        raise VLLMSetupError(f"vLLM {installed} is installed; the vllm engine supports {SUPPORTED}. Install one with "
                             f'pip install "{SUPPORTED}", or set {SKIP_VERSION_CHECK}=1 to try this one anyway')


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise VLLMSetupError("--engine vllm needs a CUDA GPU and torch sees none (torch.cuda.is_available() is "
                             "False); use --engine hf on this machine")


def require_single_rank() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise VLLMSetupError(f"--engine vllm runs vLLM inside the training process, which is one of "
                             f"{dist.get_world_size()} data-parallel ranks here; that is not supported yet. Use one "
                             "process, or --runtime ray with rollout actors of their own (--colocate none)")


# --- pure mappings (tested without vLLM) -----------------------------------------------------


def llm_kwargs(config: VLLMEngineConfig, model: torch.nn.Module) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` for the policy ``model``."""
    path = config.vllm_model_path or getattr(getattr(model, "config", None), "_name_or_path", None) \
        or getattr(model, "name_or_path", None)
    if not path:
        raise ConfigError("the vllm engine cannot tell which checkpoint the policy came from (model.config."
                          "_name_or_path is empty); set vllm_model_path in VLLMEngineConfig")
    if config.dtype == "auto":
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    else:
        dtype = DTYPES[config.dtype]
    max_len = config.max_model_len or config.max_total_tokens \
        or config.max_prompt_length + config.max_turns * config.max_new_tokens
    return dict(model=str(path), tokenizer=config.tokenizer or str(path), dtype=dtype,
                trust_remote_code=config.trust_remote_code, seed=config.seed,
                tensor_parallel_size=config.tensor_parallel_size,
                gpu_memory_utilization=config.gpu_memory_utilization, max_model_len=max_len,
                enable_prefix_caching=config.enable_prefix_caching, enforce_eager=config.enforce_eager,
                enable_sleep_mode=config.enable_sleep_mode, logprobs_mode="processed_logprobs",
                generation_config="vllm")


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokens that end a completion: the ``hf`` engine's rule."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return set(eos if isinstance(eos, list) else [eos])


def sampling_kwargs(params: SamplingParams, eos_ids: Iterable[int]) -> dict[str, Any]:
    """Arguments of ``vllm.SamplingParams`` for one sample of each row: the repetition penalty,
    temperature, top-k and top-p of ``params`` (top-k 0: off), nothing else."""
    greedy = params.temperature <= 0
    return dict(n=1, temperature=0.0 if greedy else params.temperature, top_p=1.0 if greedy else params.top_p,
                top_k=0 if greedy else params.top_k, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=params.repetition_penalty,
                min_tokens=0, max_tokens=params.max_new_tokens, stop=list(params.stop) or None,
                stop_token_ids=sorted(eos_ids), ignore_eos=True, include_stop_str_in_output=True,
                skip_special_tokens=False, detokenize=bool(params.stop),
                logprobs=0 if params.return_logprobs or params.logprobs_if_free else None)


def expand_prompts(prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt ``n`` times in a row: ``[p0, p0, .., p1, p1, ..]`` (B = prompts x n rows)."""
    return [list(ids) for ids in prompts for _ in range(n)]


def to_generation(completion: Any, eos_ids: set[int], want_logprobs: bool) -> Generation:
    """A vLLM ``CompletionOutput`` (token_ids, finish_reason, stop_reason, logprobs) as a Generation.

    A completion whose last token is EOS ended by EOS, even when vLLM calls it ``length`` (EOS
    was also the last token of the budget).
    """
    ids = [int(token) for token in completion.token_ids]
    stop_string = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    if ids and ids[-1] in eos_ids:
        finish, stop_string = "stop", None
    elif stop_string is not None or completion.finish_reason == "stop":
        finish = "stop"
    elif completion.finish_reason == "length":
        finish = "length"
    else:
        raise RuntimeError(f"vLLM ended a completion with finish reason {completion.finish_reason!r}")
    logprobs = sampled_logprobs(completion.logprobs, ids) if want_logprobs else None
    return Generation(token_ids=ids, finish_reason=finish, logprobs=logprobs, stop_string=stop_string)


def top_of(position: Any, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of one position (token id -> Logprob), most likely first."""
    entries = [(int(token), float(getattr(entry, "logprob", entry))) for token, entry in position.items()]
    return sorted(entries, key=lambda item: -item[1])[:k]


class TokenReport:
    """``on_token`` for the new tokens of each cumulative output of one request."""

    def __init__(self, on_token: Any, top_logprobs: int):
        self.on_token, self.top, self.reported = on_token, top_logprobs, 0

    def __call__(self, completion: Any) -> None:
        ids, positions = list(completion.token_ids), completion.logprobs
        for index in range(self.reported, len(ids)):
            position = positions[index] if positions is not None and index < len(positions) else None
            entry = position.get(ids[index]) if position is not None else None
            self.on_token(int(ids[index]), float(getattr(entry, "logprob", entry)) if entry is not None else 0.0,
                          top_of(position, self.top) if position is not None and self.top else [])
        self.reported = len(ids)


def cumulative() -> Any:
    """vLLM's ``RequestOutputKind.CUMULATIVE``: a stepped request reports everything it has so far
    after each step (streamed answers)."""
    return importlib.import_module("vllm.sampling_params").RequestOutputKind.CUMULATIVE


def sampled_logprobs(positions: Any, ids: list[int]) -> list[float]:
    """The sampled token's log-prob at each position (each position maps token id -> Logprob)."""
    assert positions is not None and len(positions) == len(ids), \
        f"vLLM returned {None if positions is None else len(positions)} log-prob positions for {len(ids)} tokens"
    values = []
    for position, token in zip(positions, ids):
        entry = position[token]
        values.append(float(getattr(entry, "logprob", entry)))
    return values


# --- version-specific calls ------------------------------------------------------------------


def build_llm(vllm: Any, kwargs: dict[str, Any]) -> Any:
    """``vllm.LLM`` with its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, read
    when the engine is built, 0.10-0.33), so ``collective_rpc`` hands tensors to the worker without
    serialising them (tensor parallel size 1). vLLM seeds the global RNGs of the process it runs in:
    ours are put back."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with _preserved_rng():
        return vllm.LLM(**kwargs)


def final_only() -> Any:
    """vLLM's ``RequestOutputKind.FINAL_ONLY`` (``vllm.sampling_params``, 0.10.2-0.33): a stepped
    request reports its output once, when it has finished, as ``LLM.generate`` asks for."""
    return importlib.import_module("vllm.sampling_params").RequestOutputKind.FINAL_ONLY


def _load_into_worker(worker: Any, weights: list[Named]) -> int:
    """Runs in vLLM's worker (``collective_rpc`` passes it first). ``get_model()`` unwraps CUDA-graph
    wrappers (workers of 0.10.2-0.33); the model's ``load_weights`` takes checkpoint names, fuses
    q/k/v and gate/up and shards for tensor parallelism."""
    _worker_model(worker).load_weights(weights)
    return len(weights)


def _load_recorded_into_worker(worker: Any, weights: list[Named], whole: bool) -> dict[str, Any]:
    """`_load_into_worker`, recording which parameter took which tensor (``vllm_weights.load_recorded``);
    vLLM's ``default_weight_loader`` (``model_loader.weight_utils``, 0.10-0.33) is what a parameter
    without a loader of its own gets."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    return load_recorded(_worker_model(worker), weights, default_weight_loader, params_too=whole)


def _worker_model(worker: Any) -> Any:
    return worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model


@contextlib.contextmanager
def _preserved_rng() -> Iterator[None]:
    import numpy as np

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])


# --- the engine ------------------------------------------------------------------------------


class VLLMEngine:
    """Samples with vLLM in this process; ``load_weights`` pushes the policy's weights to it."""

    shares_weights = False

    def __init__(self, model: torch.nn.Module, tokenizer: Any, config: VLLMEngineConfig | None = None):
        self.config = config or VLLMEngineConfig()
        validate(self.config)
        self.vllm = require_vllm()
        require_cuda()
        require_single_rank()
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.llm = build_llm(self.vllm, llm_kwargs(self.config, model))
        self.last_sync_seconds, self.last_sync_bytes = 0.0, 0
        self._awake = set(WAKE_TAGS)
        self._weights_lost = False  # a level-2 sleep dropped them
        self._synced_version: tuple[int, ...] | None = None  # None: push before the first generation
        self._batch: RequestBatch | None = None  # generate_one's requests in flight (one event loop)
        self._request_ids = itertools.count()

    def generate(self, prompts: list[list[int]], *, n: int, params: SamplingParams) -> list[Generation]:
        """``n`` completions per prompt, as ``[p0s0 .. p0s(n-1), p1s0, ...]``."""
        self._refuse_while_in_flight("generate")
        self._wake_for("generate")
        if self._weights_lost or self._synced_version != policy_version(self.model):
            self.load_weights(None)
        rows = expand_prompts(prompts, n)
        sampling = self.vllm.SamplingParams(**sampling_kwargs(params, self.eos_ids))
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in rows], sampling, use_tqdm=False)
        assert len(outputs) == len(rows), f"vLLM returned {len(outputs)} outputs for {len(rows)} rows"
        generations = [to_generation(out.outputs[0], self.eos_ids, params.return_logprobs or params.logprobs_if_free)
                       for out in outputs]
        if self.config.auto_sleep:
            self.sleep()
        return generations

    def continuous_for(self, params: SamplingParams) -> bool:
        """Whether rollouts go through `generate_one`: the ``continuous`` setting (any sampling)."""
        return self.config.continuous

    async def generate_one(self, prompt_ids: list[int], params: SamplingParams, *, on_token: Any = None,
                           top_logprobs: int = 0) -> Generation:
        """One completion of one prompt, decoded in vLLM's running batch with every other request
        in flight from this event loop (see `batches_continuously`). ``on_token``: the request
        reports its output after every step (``CUMULATIVE``) and each new token is passed on;
        ``top_logprobs`` k: vLLM's ``logprobs=k`` (processed log-probs, as the sampled token's)."""
        batch = self._batch_for_running_loop()
        while self._weights_lost or self._synced_version != policy_version(self.model):
            if batch.in_flight:  # new weights wait for the requests sampling from the old ones
                await batch.idle.wait()
                continue
            self._wake_for("generate")
            self.load_weights(None)
        self._wake_for("generate")
        kwargs = sampling_kwargs(params, self.eos_ids)
        if top_logprobs:
            kwargs["logprobs"] = top_logprobs
        sampling = self.vllm.SamplingParams(**kwargs, seed=params.seed,
                                            output_kind=final_only() if on_token is None else cumulative())
        report = None if on_token is None else TokenReport(on_token, top_logprobs)
        output = await batch.run(f"rlhf-{next(self._request_ids)}", prompt_ids, sampling, on_output=report)
        completion = output.outputs[0]
        generation = to_generation(completion, self.eos_ids, params.return_logprobs or bool(top_logprobs))
        if not params.return_logprobs:
            generation.logprobs = None
        if top_logprobs:
            generation.extra["top_logprobs"] = [top_of(position, top_logprobs)
                                                for position in completion.logprobs[:len(generation.token_ids)]]
        return generation

    def _batch_for_running_loop(self) -> RequestBatch:
        loop = asyncio.get_running_loop()
        if self._batch is None or self._batch.loop is not loop:
            if self._batch is not None:  # a closed loop's leftovers (its calls have ended) leave vLLM
                self._batch.abort(list(self._batch.waiting))
            self._batch = RequestBatch(self.llm.llm_engine, on_idle=self._after_continuous)
        return self._batch

    def _after_continuous(self) -> None:
        if self.config.auto_sleep:
            self.sleep()

    def _refuse_while_in_flight(self, action: str) -> None:
        if self._batch is not None and self._batch.in_flight:
            raise RuntimeError(f"vllm engine: {action}() while {self._batch.in_flight} generate_one requests are "
                               "in flight; await them first")

    # --- weights ---------------------------------------------------------------------------

    def load_weights(self, state: dict[str, torch.Tensor] | None = None) -> None:
        """Push weights to vLLM: the policy module's (``state`` None: LoRA merged, ZeRO-3 gathered)
        or those of ``state`` (full weights under the policy's names). Afterwards the engine counts
        itself in sync with the policy module as it is now."""
        named = policy_weights(self.model) if state is None else map_state_dict(state, self.model)
        self._push(bucket_by_bytes(named, max(1, int(self.config.sync_bucket_mb * 2**20))))

    def load_weights_from_group(self, group: Any, *, src: int = 0) -> None:
        """Receive weights that rank ``src`` of an initialised ``torch.distributed`` group sends with
        ``vllm_weights.send_weights`` (a trainer in another process). Unverified on a GPU."""
        device = torch.device("cuda", torch.cuda.current_device())
        sent: dict[str, Any] = {}  # the sender's checksums, once the last bucket has arrived
        self._push(receive_weights(group=group, src=src, device=device, sent_checksums=sent), sender=sent)

    def _push(self, buckets: Iterator[list[Named]], sender: dict[str, Any] | None = None) -> None:
        """Load ``buckets`` into vLLM's workers, verified (``verify_weight_sync``); ``sender``: the
        checksums another process sent with them (filled when the last bucket has arrived), compared
        with what arrived here."""
        started = time.perf_counter()
        self._wake_for("load_weights")
        verify, whole = self.config.verify_weight_sync, self.config.tensor_parallel_size == 1
        sent: dict[str, Any] = {}
        records: list[list[dict[str, Any]]] = []  # per bucket: each worker's record
        loaded = 0
        self._weights_lost = True  # until this sync has ended and passed: a timeout leaves a half-loaded model
        with sync_deadline(self.config.weight_sync_timeout_s, "the weight sync to the vllm engine"):
            for bucket in buckets:
                if not whole:  # pickled to worker processes: CPU tensors travel best
                    bucket = [(name, tensor.cpu()) for name, tensor in bucket]
                if verify:
                    arrived = sender is not None or not whole  # from another process: compared with its sums
                    sent.update((name, weight_checksum(tensor) if arrived else None) for name, tensor in bucket)
                    records.append(self.llm.collective_rpc(_load_recorded_into_worker, args=(bucket, whole)))
                else:
                    self.llm.collective_rpc(_load_into_worker, args=(bucket,))
                loaded += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            problems = self._verify(sent, records) if verify else []
            if verify and sender:  # what arrived here against what the other process sent
                problems += [f"{name} arrived with other values than the trainer sent"
                             for name, value in sender.items() if tuple(sent.get(name) or ()) != tuple(value)]
        self.llm.reset_prefix_cache()  # cached keys/values were computed with the old weights
        self.last_sync_seconds, self.last_sync_bytes = time.perf_counter() - started, loaded
        if problems:
            self._weights_lost = True  # never sample from them: the next generation syncs again (if the run goes on)
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise WeightSyncError(f"the weight sync to the vllm engine failed verification: {problems[0]}{more}; "
                                  "vLLM would sample from weights the policy does not have, so the run stopped "
                                  "(--no-verify-weight-sync turns the check off)")
        self._synced_version, self._weights_lost = policy_version(self.model), False
        log.debug("vllm engine: loaded %d bytes of weights in %.3f s", loaded, self.last_sync_seconds)

    @staticmethod
    def _verify(sent: dict[str, Any], records: list[list[dict[str, Any]]]) -> list[str]:
        """Each worker's problems (`vllm_weights.verify_records`) after a sync."""
        problems: list[str] = []
        for worker_records in (zip(*records) if records else [()]):
            problems += verify_records(sent, list(worker_records))
        return list(dict.fromkeys(problems))

    # --- sleep mode ------------------------------------------------------------------------

    def sleep(self, level: int | None = None) -> None:
        """Free vLLM's GPU memory (level 1: weights to CPU; 2: weights dropped); the KV cache is dropped."""
        self._require_sleep_mode("sleep")
        self._refuse_while_in_flight("sleep")
        level = self.config.sleep_level if level is None else level
        if level not in (1, 2):
            raise ConfigError(f"sleep level must be 1 or 2, got {level}")
        if not self._awake:
            return
        if self._awake != set(WAKE_TAGS):  # vLLM ignores sleep() while anything still sleeps
            self.wake_up()
        self.llm.sleep(level=level)
        self._awake = set()
        self._weights_lost |= level == 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of ``tags`` (``weights``, ``kv_cache``; None: both)."""
        self._require_sleep_mode("wake_up")
        wanted = list(WAKE_TAGS) if tags is None else list(tags)
        unknown = sorted(set(wanted) - set(WAKE_TAGS))
        if unknown:
            raise ConfigError(f"wake_up tags must be among {', '.join(WAKE_TAGS)}; got {', '.join(unknown)}")
        missing = [tag for tag in WAKE_TAGS if tag in wanted and tag not in self._awake]
        if missing:
            self.llm.wake_up(None if len(missing) == len(WAKE_TAGS) else missing)
            self._awake.update(missing)

    def _wake_for(self, action: str) -> None:
        """What ``action`` needs awake: ``load_weights`` the weights, ``generate`` everything."""
        needed = ("weights",) if action == "load_weights" else WAKE_TAGS
        if any(tag not in self._awake for tag in needed):
            self.wake_up(list(needed))

    def _require_sleep_mode(self, action: str) -> None:
        if not self.config.enable_sleep_mode:
            raise ConfigError(f"vllm engine: {action}() needs an engine built with enable_sleep_mode=True "
                              "(VLLMEngineConfig); this one was built without it")
