"""The ``deepspeed`` training backend: ZeRO data parallelism (Rajbhandari et al., 2020,
arXiv:1910.02054) and ZeRO-Offload (Ren et al., 2021, arXiv:2101.06840), behind the same contract
as the ``torch`` backend, so a run gives the same updates with either.

Stages: 0 replicates everything (plain data parallelism), 1 shards the optimizer states over the
ranks, 2 also the gradients, 3 also the parameters (gathered layer by layer, by DeepSpeed's module
hooks, whenever a forward runs). ``offload_optimizer`` keeps the optimizer states and fp32 master
weights in CPU memory and steps them with DeepSpeedCPUAdam (stages 1-3); ``offload_params``
keeps the parameters there between uses (stage 3). Parameters in bf16 or fp16 turn on DeepSpeed's
mixed precision (fp32 master weights; dynamic loss scaling for fp16).

How the contract maps onto DeepSpeed:

* the optimizer is a torch AdamW given to DeepSpeed (no C++ build; DeepSpeedCPUAdam when the
  optimizer is offloaded) and the LR schedule is the ``torch`` backend's warmup + constant/cosine
  (`lr_factor`), so trajectories match that backend;
* gradient accumulation is ours: DeepSpeed runs with ``managed_gradient_accumulation`` off
  (DeepSpeed >= 0.19.5), so every ``backward`` only accumulates and every ``step`` is a boundary,
  whatever the number of micro-batches, and losses are never divided by an accumulation count
  (they are already shares of the step loss);
* DeepSpeed averages gradients over ranks and our losses are shares of the step loss, so each
  loss is multiplied by the world size: the average of the scaled gradients is their sum;
* training forwards must go through the engine (`train_module`): DeepSpeed hooks the start of
  each backward there. Other forwards (log-probs, generation) may call the model itself; under
  ZeRO-3 with several ranks each forward is a collective, so generation runs in lockstep
  (``shards_weights``);
* ``zero_grad`` after some backwards (a non-finite micro-batch loss ends the step) cannot reach
  DeepSpeed's reduced gradient buffers, so it poisons them and lets DeepSpeed skip the step.

Deviations: stage 0 in fp32 clips with torch's ``clip_grad_norm_`` inside the optimizer (DeepSpeed
would clip but not report the norm). ZeRO-3 exports gather the whole model on every rank at once.
Models are loaded whole on every rank before ZeRO-3 partitions them (no ``zero.Init``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlhf.api import ConfigError, RlhfError, TrainBackendBase
from rlhf.plugins.backends.config import DeepSpeedConfig
from rlhf.plugins.backends.torch_backend import lr_factor

log = logging.getLogger(__name__)

CHECKPOINT_TAG = "deepspeed"  # the folder DeepSpeed writes inside a worker's checkpoint folder
MIN_VERSION = "0.19.5"  # managed_gradient_accumulation=false for stages 0-3 and offload


def check_precision(dtype: torch.dtype) -> None:
    """DeepSpeed refuses half precision a device lacks (fp16 on most CPUs); say what to do instead."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = {torch.bfloat16: accelerator.is_bf16_supported, torch.float16: accelerator.is_fp16_supported}
    if dtype in supported and not supported[dtype]():
        raise ConfigError(f"DeepSpeed does not support {dtype} on this device ({accelerator.device_name()}); "
                          "use --dtype fp32 or another half-precision --dtype")


# DeepSpeed's default gradient bucket, in elements: ZeRO-3 allocates one of this size per engine
DEFAULT_REDUCE_BUCKET = 500_000_000


def deepspeed_config(config: DeepSpeedConfig, dtype: torch.dtype, trainable_elements: int) -> dict[str, Any]:
    """DeepSpeed's JSON config for this run (batch sizes are bookkeeping: we own accumulation).

    The gradient bucket is never larger than the model's trainable elements: ZeRO-3 allocates it
    whole when the engine starts (2 GB in fp32 at DeepSpeed's default), and a bucket that holds
    every gradient already reduces them all at once. Buckets only group the same elementwise
    reductions, so their size changes no value.
    """
    zero: dict[str, Any] = {"stage": config.zero_stage,
                            "reduce_bucket_size": min(DEFAULT_REDUCE_BUCKET, max(1, trainable_elements))}
    if config.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if config.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # each step() is a boundary; backward() only accumulates
        "gradient_clipping": 0.0 if clips_in_optimizer(config, dtype) else config.max_grad_norm,
        "zero_optimization": zero,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if dtype == torch.bfloat16:
        values["bf16"] = {"enabled": True}
    elif dtype == torch.float16:
        values["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if dtype != torch.float32 and config.zero_stage > 0:
        values["data_types"] = {"grad_accum_dtype": "fp32"}  # micro-batch gradients add up in fp32
    return values


def clips_in_optimizer(config: DeepSpeedConfig, dtype: torch.dtype) -> bool:
    """Stage 0 in fp32: DeepSpeed steps our optimizer itself and would clip without reporting the
    norm, so `ClippingAdamW` clips. Otherwise DeepSpeed's ZeRO/mixed-precision optimizer does."""
    return config.zero_stage == 0 and dtype == torch.float32


class ClippingAdamW(torch.optim.AdamW):
    """AdamW that clips the global gradient norm first and skips a non-finite step.

    Used for stage 0 in fp32, where DeepSpeed steps the client optimizer directly: the engine
    reads ``_global_grad_norm`` and ``overflow`` from it (a skipped step leaves the LR schedule).
    """

    def __init__(self, params: list[torch.nn.Parameter], *, max_grad_norm: float, **kwargs: Any):
        super().__init__(params, **kwargs)
        self.max_grad_norm = max_grad_norm if max_grad_norm > 0 else math.inf
        self._global_grad_norm: float | None = None
        self.overflow = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        self._global_grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        self.overflow = not math.isfinite(self._global_grad_norm)
        if self.overflow:
            return None
        return super().step(closure)


def join_process_group() -> None:
    """DeepSpeed's communication state over this process's torch.distributed group.

    Under a launcher or in a Ray actor the group exists (or the environment describes it); a
    process on its own gets a one-rank group held in memory (no port, no file).
    """
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    from rlhf.api import init_from_environment

    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            init_from_environment()
        else:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    os.environ.setdefault("LOCAL_RANK", "0")  # the engine insists on it; a lone process is local rank 0
    # DeepSpeed builds a shared-memory C++ op when it joins a group, used only by its inference
    # all-reduce, which training never calls: skip the build (20 s to minutes of g++ on first use).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
    quiet_deprecated_collectives()


def quiet_deprecated_collectives() -> None:
    """ZeRO-3 calls collectives that torch has deprecated, and torch warns on every call (~4 lines a
    step); DeepSpeed's business, not the user's."""
    for name in ("reduce_scatter_tensor", "all_gather_into_tensor", "_reduce_scatter_base", "_all_gather_base"):
        warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.{name}` is deprecated",
                                category=FutureWarning)


def announce_cpu_adam_build(log: logging.Logger) -> None:
    """DeepSpeedCPUAdam compiles a C++ op on its first use on a machine (minutes of g++, silently): say so."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        installed_ops = {}
    if installed_ops.get("cpu_adam"):
        return
    from torch.utils.cpp_extension import _get_build_directory

    name = CPUAdamBuilder().name
    if any(Path(_get_build_directory(name, verbose=False)).glob(f"{name}*.so")):
        return
    log.warning("--offload-optimizer: building DeepSpeed's CPU Adam op (first use on this machine; a few minutes of "
                "g++, reused by later runs)")


def _import_deepspeed() -> Any:
    from packaging.version import Version

    try:
        import deepspeed
    except ImportError as exc:
        raise ConfigError(f"--backend deepspeed needs the deepspeed package: pip install 'deepspeed>={MIN_VERSION}' "
                          f"(import failed: {exc})") from exc
    if Version(deepspeed.__version__) < Version(MIN_VERSION):
        raise ConfigError(f"--backend deepspeed needs deepspeed>={MIN_VERSION} (caller-owned gradient accumulation); "
                          f"this is {deepspeed.__version__}: pip install -U deepspeed")
    return deepspeed


class DeepSpeedBackend(TrainBackendBase):
    """Optimizer steps for one model through a DeepSpeed engine (every rank holds one)."""

    shards_state = True  # DeepSpeed's checkpoints: every rank writes its partition (at every stage)

    def __init__(self, model: torch.nn.Module, config: DeepSpeedConfig):
        deepspeed = _import_deepspeed()
        import torch.distributed as dist

        super().__init__(model)
        self.config = config
        params = [p for p in model.parameters() if p.requires_grad]
        assert params, "the model has no trainable parameters"
        dtype = params[0].dtype
        join_process_group()
        check_precision(dtype)
        self.world_size = dist.get_world_size()
        trainable = sum(param.numel() for param in params)
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=self._optimizer(params, dtype), config=deepspeed_config(config, dtype, trainable),
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: lr_factor(step, config)),
            dist_init_required=False)
        self.pending_backwards = 0
        self.away: Any = None  # stage 0's --offload-train-state

    def _optimizer(self, params: list[torch.nn.Parameter], dtype: torch.dtype) -> torch.optim.Optimizer:
        config = self.config
        hyper = dict(lr=config.lr, betas=config.adam_betas, eps=config.adam_eps, weight_decay=config.weight_decay)
        if config.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # compiles its C++ op on first use

            announce_cpu_adam_build(log)
            return DeepSpeedCPUAdam(params, adamw_mode=True, **hyper)
        if clips_in_optimizer(config, dtype):
            return ClippingAdamW(params, max_grad_norm=config.max_grad_norm, **hyper)
        return torch.optim.AdamW(params, **hyper)

    # --- the backend contract -----------------------------------------------------------------

    @property
    def train_module(self) -> torch.nn.Module:
        """What training forwards call: the engine, which hooks the backward that follows."""
        return self.engine

    @property
    def shards_weights(self) -> bool:
        """ZeRO-3 partitions the parameters and gathers them inside every forward, a collective:
        ranks that finish generating early must keep stepping until all have finished."""
        return self.config.zero_stage == 3

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed averages over ranks; each rank's loss is its share of the step loss, so
        # scaling by the world size makes the average the sum.
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        self.pending_backwards += 1

    def step(self) -> dict[str, float]:
        """Reduce, clip, then step unless the gradient is NaN/inf; gradients are cleared either way."""
        lr = float(self.engine.get_lr()[0])
        skipped_before = self.engine.skipped_steps
        self.engine.step()
        self.pending_backwards = 0
        norm = self.engine.get_global_grad_norm()
        skipped = self.engine.skipped_steps > skipped_before
        grad_norm = float(norm) if norm is not None else math.nan
        return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step.

        They sit in DeepSpeed's own buffers (reduced, partitioned), out of reach; so one more
        backward of a NaN makes the step that follows overflow, and DeepSpeed clears every buffer
        and skips it (the LR schedule does not advance; fp16 halves its loss scale). The forward
        it takes is a collective under ZeRO-3, like every step: all ranks must drop together.
        """
        if self.pending_backwards == 0:
            self.engine.zero_grad()
            return
        device = next(self.model.parameters()).device
        token = torch.zeros((1, 1), dtype=torch.long, device=device)  # (1, 1)
        output = self.engine(input_ids=token, attention_mask=torch.ones_like(token))
        first = output.logits if hasattr(output, "logits") else output
        self.engine.backward(first.float().sum() * math.nan, scale_wrt_gas=False)
        self.step()

    def offload_state(self, params: bool = False) -> int:
        """The training state off the device (``--offload-train-state``): DeepSpeed's own
        ``offload_states`` at stages 1-3 (optimizer states, fp32 master weights, gradient partitions;
        with ``params`` at stage 3 the parameter partitions too), the client optimizer's state at stage 0.
        What DeepSpeed already keeps on the CPU (``offload_optimizer``) stays. Returns the bytes moved
        (0: DeepSpeed does not say)."""
        from rlhf.api import TensorOffload, TrainStateOffload

        config, optimizer = self.config, self.engine.optimizer
        if config.zero_stage == 0:  # the client optimizer, stepped by DeepSpeed as it is
            self.away = self.away or [TrainStateOffload(optimizer, [p for p in self.model.parameters()
                                                                    if p.requires_grad])]
            return sum(part.offload() for part in self.away)
        if config.offload_params:  # DeepSpeed cannot move states of CPU-offloaded parameters
            return 0
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum as State

        include = [State.lp_grads]
        if config.zero_stage == 3:
            include.append(State.contiguous_grad_buffer)
            if params:
                include.append(State.lp_params)
            if not config.offload_optimizer:  # ZeRO-3 moves its optimizer's state only for FusedAdam: ours here
                self.away = self.away or [TrainStateOffload(optimizer.optimizer, []),
                                          TensorOffload(optimizer.fp32_partitioned_groups_flat)]
        else:
            include += [State.optim_states, State.hp_params]  # (left out by DeepSpeed under offload_optimizer)
        self.engine.offload_states(include=include, device=OffloadDeviceEnum.cpu,
                                   pin_memory=torch.cuda.is_available())
        return sum(part.offload() for part in self.away or [])

    def reload_state(self) -> None:
        if self.config.zero_stage != 0 and not self.config.offload_params:
            self.engine.reload_states()
        for part in self.away or []:
            part.reload()

    def state_dict(self) -> dict[str, Any]:
        """Nothing replicated: the whole state is in DeepSpeed's checkpoints (``shards_state``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing replicated to load (``shards_state``)."""

    def save_checkpoint(self, directory: Path) -> None:
        """Module, optimizer and schedule, each rank writing its own shards (all ranks call this)."""
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, client_state={}, save_latest=False)

    def load_checkpoint(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise RlhfError(f"{directory} holds no DeepSpeed checkpoint (expected {directory / CHECKPOINT_TAG}); "
                            "was it written with --backend deepspeed?")

    @contextlib.contextmanager
    def full_weights(self) -> Iterator[None]:
        """Within this, the model's parameters are whole on every rank (all ranks must enter):
        for exporting the model. Stages 0-2 keep them whole anyway."""
        if self.config.zero_stage != 3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
            yield
