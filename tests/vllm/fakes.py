"""A stand-in for the parts of vLLM the ``vllm`` engine touches, to test it without a GPU.

`install(monkeypatch)` puts a fake ``vllm`` module in ``sys.modules``, reports a supported
installed version and a CUDA device, and returns the module; every `FakeLLM` it builds records
its constructor arguments and each call, and its worker's model keeps the weights it was given.
Completions are scripted: each row gets ``script(prompt_ids, sampling_kwargs)``. Its
``llm_engine`` (`FakeLLMEngine`) is vLLM's engine as a caller that steps it sees: requests join
the running batch at the next step, get one token a step, and leave at the step of their last.
"""

from __future__ import annotations

import enum
import importlib.metadata
import random
import sys
import types
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: Any = None
    index: int = 0
    text: str = ""


@dataclass
class RequestOutput:
    outputs: list[Completion]
    request_id: str = ""
    finished: bool = True


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class FakeSamplingParams:
    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs


@dataclass
class Running:
    external_id: str
    completion: Completion
    sampling: FakeSamplingParams
    emitted: int = 0


@dataclass
class FakeLLMEngine:
    """``LLM.llm_engine``: ``add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests``.

    ``add_request`` scripts the whole completion at once (``llm.script``); each `step` decodes
    every running request one token further, records the ids it decoded in ``batches``, and
    returns the final `RequestOutput` of each request whose last token it produced (``FINAL_ONLY``),
    and for a ``CUMULATIVE`` request an unfinished one with what it has so far at the other steps.
    ``internal_ids``: ``add_request`` returns an id of its own (``<id>-internal``, as later vLLM
    releases may) and reports outputs under it. ``fail_at_step``: that step raises.
    """

    llm: Any
    running: dict[str, Running] = field(default_factory=dict)  # vLLM's id -> request
    added: list[str] = field(default_factory=list)
    sampling: dict[str, FakeSamplingParams] = field(default_factory=dict)  # by the caller's id
    prompts: dict[str, list[int]] = field(default_factory=dict)  # by the caller's id
    batches: list[list[str]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    internal_ids: bool = False
    fail_at_step: int | None = None

    def add_request(self, request_id, prompt, params):
        if request_id in self.added:
            raise ValueError(f"request id {request_id} is already in use")
        if not prompt["prompt_token_ids"]:
            raise ValueError("The decoder prompt cannot be empty")  # vLLM's refusal
        if not isinstance(params.kwargs.get("output_kind"), RequestOutputKind):
            raise TypeError("a stepped request needs an output kind")
        self.llm.calls.append("add_request")
        used = f"{request_id}-internal" if self.internal_ids else request_id
        self.added.append(request_id)
        self.sampling[request_id] = params
        self.prompts[request_id] = list(prompt["prompt_token_ids"])
        completion = self.llm.script(list(prompt["prompt_token_ids"]), params.kwargs)
        self.running[used] = Running(request_id, completion, params)
        return used if self.internal_ids else None

    def step(self):
        if self.fail_at_step == len(self.batches) + 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.batches.append(sorted(request.external_id for request in self.running.values()))
        if self.llm.calls[-1:] != ["step"]:
            self.llm.calls.append("step")
        finished = []
        for used, request in list(self.running.items()):
            request.emitted += 1
            if request.emitted >= len(request.completion.token_ids):
                del self.running[used]
                finished.append(RequestOutput(outputs=[request.completion], request_id=used, finished=True))
            elif request.sampling.kwargs["output_kind"] is RequestOutputKind.CUMULATIVE:  # what it has so far
                done, logprobs = request.emitted, request.completion.logprobs
                finished.append(RequestOutput(outputs=[Completion(
                    token_ids=request.completion.token_ids[:done], finish_reason=None,
                    logprobs=logprobs[:done] if logprobs is not None else None)], request_id=used, finished=False))
        return finished

    def abort_request(self, request_ids):
        for external in request_ids:
            used = next((u for u, r in self.running.items() if r.external_id == external), None)
            if used is not None:
                del self.running[used]
                self.aborted.append(external)

    def has_unfinished_requests(self):
        return bool(self.running)


def default_weight_loader(param, loaded):
    """vLLM's ``default_weight_loader``: the whole tensor into the parameter."""
    param.data.copy_(loaded)


class FakeModel:
    """vLLM's model inside the worker. Its parameters are the checkpoint's (``model.safetensors`` of the
    directory vLLM was started from; a name it lacks is refused, as vLLM refuses it), in ``dtype``;
    ``load_weights`` hands each tensor to its parameter's ``weight_loader`` (vLLM's default when it
    has none), as vLLM's models do, and keeps a copy under the name it got (``loaded``).

    Faults, for the verification tests (each from sync ``faults_from`` on, counting from 1):
    ``drop``: names it skips (vLLM's MoE models once left experts stale this way); ``corrupt``: names
    whose parameter gets one element changed after loading; ``hang``: load_weights never returns
    (it waits in Python, so a deadline can interrupt it)."""

    def __init__(self, path: str | None = None, dtype: str = "float32") -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.batches: list[list[str]] = []
        self.params: dict[str, torch.nn.Parameter] = {}
        self.drop: set[str] = set()
        self.corrupt: set[str] = set()
        self.hang = False
        self.faults_from = 2
        self.syncs = 0  # syncs ended (each ends with reset_prefix_cache)
        file = Path(path) / "model.safetensors" if path else None
        if file is not None and file.is_file():
            from safetensors.torch import load_file

            torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and hasattr(torch, dtype) else torch.float32
            for name, tensor in load_file(str(file)).items():
                self.params[name] = torch.nn.Parameter(torch.zeros_like(tensor, dtype=torch_dtype), requires_grad=False)

    def named_parameters(self):
        return iter(self.params.items())

    def load_weights(self, weights):
        faulty = self.syncs + 1 >= self.faults_from
        if self.hang and faulty:
            import threading

            stop = threading.Event()
            while not stop.wait(0.01):  # Python-level waiting: an async exception interrupts it
                pass
        weights = list(weights)
        self.batches.append([name for name, _ in weights])
        for name, tensor in weights:
            self.loaded[name] = tensor.detach().clone()
            if faulty and name in self.drop:
                continue
            param = self.params.get(name)
            if param is None:
                if self.params:
                    raise KeyError(f"vLLM's model has no parameter {name}")
                param = self.params[name] = torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False)
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor)
            if faulty and name in self.corrupt:
                param.data.view(-1)[0] += 1.0
class FakeWorker:
    def __init__(self, path: str | None = None, dtype: str = "float32") -> None:
        self.model = FakeModel(path, dtype)

    def get_model(self) -> FakeModel:
        return self.model


def echo_script(prompt: list[int], sampling: dict[str, Any]) -> Completion:
    """Two tokens, the prompt's length then the first stop token id (EOS), log-probs -0.5 and -0.25."""
    eos = sampling["stop_token_ids"][0]
    ids = [len(prompt), eos]
    logprobs = [{ids[0]: Logprob(-0.5)}, {ids[1]: Logprob(-0.25)}] if sampling["logprobs"] is not None else None
    return Completion(token_ids=ids, finish_reason="stop", logprobs=logprobs)


class FakeLLM:
    instances: list[FakeLLM] = []
    script = staticmethod(echo_script)

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs
        self.calls: list[Any] = []
        self.worker = FakeWorker(kwargs.get("model"), kwargs.get("dtype", "float32"))
        self.prompts: list[list[int]] = []
        self.llm_engine = FakeLLMEngine(self)
        # vLLM seeds the process's global generators when its engine core runs in-process
        random.seed(kwargs.get("seed", 0))
        torch.manual_seed(kwargs.get("seed", 0))
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling, *, use_tqdm=True):
        self.calls.append("generate")
        self.sampling = sampling
        self.prompts = [p["prompt_token_ids"] for p in prompts]
        return [RequestOutput(outputs=[self.script(p, sampling.kwargs)]) for p in self.prompts]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append("collective_rpc")
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        """Refused (False), as vLLM refuses it, while requests hold KV-cache blocks."""
        self.calls.append("reset_prefix_cache")
        self.worker.model.syncs += 1
        return not self.llm_engine.running

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


def install(monkeypatch, version: str = "0.11.0") -> types.ModuleType:
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = FakeSamplingParams
    module.__version__ = version
    sampling_module = types.ModuleType("vllm.sampling_params")
    sampling_module.RequestOutputKind = RequestOutputKind
    sampling_module.SamplingParams = FakeSamplingParams
    module.sampling_params = sampling_module
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling_module)
    for package in ("vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
    weight_utils = types.ModuleType("vllm.model_executor.model_loader.weight_utils")
    weight_utils.default_weight_loader = default_weight_loader
    monkeypatch.setitem(sys.modules, weight_utils.__name__, weight_utils)
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: version if name == "vllm" else real_version(name))
    from rlhf.plugins.engines import vllm_engine

    monkeypatch.setattr(vllm_engine, "require_cuda", lambda: None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine sets 0; monkeypatch puts it back
    FakeLLM.instances = []
    FakeLLM.script = staticmethod(echo_script)
    return module


class MoENameLoader:
    """How vLLM's Mixtral and Qwen2-MoE ``load_weights`` route checkpoint names to their parameters,
    written from vLLM's model files (``vllm/model_executor/models/mixtral.py``, ``qwen2_moe.py``):
    q/k/v go into the fused ``qkv_proj`` (and Qwen2-MoE's shared expert's gate/up into its
    ``gate_up_proj``); an expert's tensors ``experts.{e}.{gate}.``, ``{up}.``, ``{down}.`` (Mixtral:
    w1, w3, w2; Qwen2-MoE: gate_proj, up_proj, down_proj) go into the layer's fused ``experts.w13_``
    and ``experts.w2_`` parameters (``FusedMoE.make_expert_params_mapping``) as shard of expert e;
    anything else must be one of the model's own parameter names. ``load(names)`` returns the
    (parameter, shard) pairs loaded and raises KeyError for a name vLLM's model would not find."""

    def __init__(self, model_type: str, layers: int, experts: int, *, tied: bool = False):
        self.model_type = model_type
        if model_type == "mixtral":
            block, self.expert_names, extra = "block_sparse_moe", ("w1", "w3", "w2"), []
        else:
            block, self.expert_names = "mlp", ("gate_proj", "up_proj", "down_proj")
            extra = ["mlp.shared_expert.gate_up_proj.weight", "mlp.shared_expert.down_proj.weight",
                     "mlp.shared_expert_gate.weight", "self_attn.qkv_proj.bias"]
        per_layer = ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight", f"{block}.gate.weight",
                     f"{block}.experts.w13_weight", f"{block}.experts.w2_weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight", *extra]
        self.params = {"model.embed_tokens.weight", "model.norm.weight", *(() if tied else ("lm_head.weight",))}
        self.params |= {f"model.layers.{i}.{name}" for i in range(layers) for name in per_layer}
        gate, up, down = self.expert_names
        self.expert_mapping = [("experts.w13_" if name in (gate, up) else "experts.w2_", f"experts.{e}.{name}.", e, name)
                               for e in range(experts) for name in (gate, down, up)]
        self.stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v")]
        if model_type != "mixtral":
            self.stacked += [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def load(self, names: list[str]) -> list[tuple[str, Any]]:
        loaded = []
        for name in names:
            for param, weight, shard in self.stacked:
                if weight not in name or "mlp.experts" in name:  # experts are handled below, as vLLM does
                    continue
                loaded.append((self._param(name.replace(weight, param)), shard))
                break
            else:
                for param, weight, expert, shard in self.expert_mapping:
                    if weight not in name:
                        continue
                    loaded.append((self._param(name.replace(weight, param)), (expert, shard)))
                    break
                else:
                    loaded.append((self._param(name), None))
        return loaded

    def _param(self, name: str) -> str:
        if name not in self.params:
            raise KeyError(f"vLLM's {self.model_type} model has no parameter {name}")
        return name


def make_engine(policy, **settings):
    """A `VLLMEngine` on the ``policy`` fixture's model and tokenizer (with the stand-in installed)."""
    from rlhf.plugins.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

    model, tokenizer = policy
    return VLLMEngine(model, tokenizer, VLLMEngineConfig(**settings))
