"""One side of one benchmark job, in a process of its own: `benchmarks/harness.py` starts it.

    python benchmarks/bench_worker.py prepare --work-dir W --jobs grpo-small,dpo,...   # with rlhf's Python
    python benchmarks/bench_worker.py run --side rlhf|trl|floor --job JOB --work-dir W --steps N --out R.json

`prepare` (rlhf's interpreter) builds the random models, the prompts, the reward file, the offline
rows and the order in which the offline jobs take their rows (rlhf's own `StepOrder` for the seed),
so that the TRL and floor processes read files and never import rlhf; the `trl` side never imports
rlhf and the `rlhf` and `floor` sides never import trl (checked at the end of each run).

`run` trains for ``--steps`` optimizer steps with one torch thread and writes a JSON file: per step
the process's CPU time (user + sys from ``getrusage(RUSAGE_SELF)``, every thread of the process),
wall time and the work done (generated tokens, trained samples and tokens, read from the run's
own metrics or from counters around the loss), and for the run the peak resident set
(``ru_maxrss``), the load average at start and end, the versions, the glibc mmap threshold in
force (``MALLOC_MMAP_THRESHOLD_``) and, on rlhf's side, which linear kernels ran.

The jobs (`JOBS`): GRPO on `small` (4.4M, vocabulary 320) and `vocab152k` (95M, Qwen2's vocabulary,
tied), 8 prompts x 4 samples x 64 new tokens (EOS unreachable: every completion is 64 tokens),
micro-batches of 8 (4 accumulated), β = 0, token-mean loss, one AdamW step per rollout, the
`count_a_dense` reward (no group ties, so rlhf skips no sample's update that TRL trains); DPO
(sigmoid, β = 0.1, frozen reference) and SFT (loss on the completion and EOS) on `small`-sized
Llamas, 32 rows a step in micro-batches of 8, the rows of each step the same on every side;
`sft-packing`: rlhf's ``--packing`` against TRL's ``padding_free``, the floor packed likewise;
`dpo-packing`: rlhf's ``--packing`` against TRL's padded DPO (TRL 1.16 turns its DPO ``padding_free``
off) and the padded floor.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import benchlib  # noqa: E402  (imports no rlhf, no torch at module level)

SEED = 0
GRPO = dict(prompts=8, n=4, max_new_tokens=64, micro_batch_size=8, lr=1e-4, reward="count_a_dense", lora_rank=0)
OFFLINE = dict(batch_size=32, micro_batch_size=8, lr=1e-4, beta=0.1)
JOBS: dict[str, dict[str, Any]] = {
    "grpo": dict(kind="grpo", model="small", steps=3),  # benchmarks/scale.py's points: shape from --set
    "grpo-small": dict(kind="grpo", model="small", steps=5),
    "grpo-vocab152k": dict(kind="grpo", model="vocab152k", steps=3),
    "dpo": dict(kind="dpo", model="small", steps=5),
    "sft": dict(kind="sft", model="small", steps=5),
    "sft-packing": dict(kind="sft", model="small", steps=5, packing=True),
    "dpo-packing": dict(kind="dpo", model="small", steps=5, packing=True),
}
WORDS = "the quick brown fox jumps over a lazy dog while seven small cats sing about green apples".split()


# ---------------------------------------------------------------------------------------------- files

def offline_model_dir(root: Path) -> Path:
    hidden, layers, _ = benchlib.MODELS["small"]
    return root / f"offline-small-h{hidden}-l{layers}"


def offline_rows(job: str, rows: int) -> list[dict[str, str]]:
    """Prompt/completion (SFT) or prompt/chosen/rejected (DPO) rows of mixed lengths."""
    rng = random.Random(SEED)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    if JOBS[job]["kind"] == "sft":
        return [{"prompt": f"Q: {text(2, 12)}?", "completion": " " + text(3, 30)} for _ in range(rows)]
    return [{"prompt": f"Q: {text(2, 12)}?", "chosen": " " + text(3, 20), "rejected": " " + text(3, 20)}
            for _ in range(rows)]


def job_files(root: Path, job: str) -> dict[str, Path]:
    spec = JOBS[job]
    if spec["kind"] == "grpo":
        return {"model": benchlib.model_path(spec["model"], root), "data": root / "prompts.jsonl",
                "reward": root / "count_a.py"}
    kind = spec["kind"]
    return {"model": offline_model_dir(root), "data": root / f"offline-{kind}.jsonl",
            "order": root / f"offline-{kind}-order.json"}


def prepare(root: Path, jobs: list[str], steps: dict[str, int]) -> None:
    """Build every file the jobs read (rlhf's interpreter: the models come from examples/tiny_model.py)."""
    benchlib.setup_environment(1)
    from rlhf.core.plugin_host.references import import_object
    from rlhf.runtime.fit.data import StepOrder

    root.mkdir(parents=True, exist_ok=True)
    heap: dict[str, int] = {}
    for job in jobs:
        spec, files = JOBS[job], job_files(root, job)
        heap[job] = rlhf_threshold(files["model"]) if spec["kind"] != "grpo" else 0
        if spec["kind"] == "grpo":
            assert benchlib.model_dir(spec["model"], root) == files["model"]
            benchlib.write_task(root)
            heap[job] = rlhf_threshold(files["model"])
            continue
        if not (files["model"] / "config.json").is_file():
            hidden, layers, _ = benchlib.MODELS["small"]
            build = import_object(f"{benchlib.ROOT / 'examples' / 'tiny_model.py'}:build_random_model")
            build(files["model"], hidden=hidden, layers=layers, heads=max(1, hidden // 64), max_positions=1024)
        rows = OFFLINE["batch_size"] * max(steps[j] for j in jobs)
        files["data"].write_text("".join(json.dumps(row) + "\n" for row in offline_rows(job, rows)))
        # rlhf takes step k's rows from StepOrder (a seeded shuffle); TRL and the floor take the same rows
        order = StepOrder(rows, OFFLINE["batch_size"], seed=SEED)
        files["order"].write_text(json.dumps([order.indices(k) for k in range(rows // OFFLINE["batch_size"])]))
        heap[job] = rlhf_threshold(files["model"])
    (root / "heap.json").write_text(json.dumps(heap))
    from rlhf.runtime.run import heap as run_heap

    capacity = getattr(run_heap, "KERNEL_CACHE_CAPACITY", None)  # None: an rlhf that leaves oneDNN's caches alone
    (root / "kernel_caches.json").write_text(json.dumps({"capacity": capacity}))


def rlhf_threshold(model: Path) -> int:
    """The glibc mmap threshold rlhf's run prologue sets for ``model`` (rlhf.runtime.run.heap; an
    rlhf without a per-model choice fixes 1 MiB)."""
    from rlhf.runtime.run import heap

    choose = getattr(heap, "threshold_for", None)
    return choose(str(model)) if choose else heap.MMAP_THRESHOLD


# ---------------------------------------------------------------------------------------------- clock

class Clock:
    """CPU (user + sys of every thread of this process) and wall time at the start and each step's end."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.work: list[dict[str, float]] = []
        self.pending: dict[str, float] = {}

    @staticmethod
    def _cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def start(self) -> None:
        self.cpu, self.wall, self.work, self.pending = [self._cpu()], [time.perf_counter()], [], {}

    def count(self, **work: float) -> None:
        for key, value in work.items():
            self.pending[key] = self.pending.get(key, 0.0) + float(value)

    def stamp(self, **work: float) -> None:
        self.cpu.append(self._cpu())
        self.wall.append(time.perf_counter())
        self.count(**work)
        self.work.append(self.pending)
        self.pending = {}


# ---------------------------------------------------------------------------------------------- rlhf

def run_rlhf(job: str, root: Path, steps: int, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    import rlhf
    from rlhf.core.plugin_host.loading import build_plugin_manager

    spec, files = JOBS[job], job_files(root, job)
    out = root / "runs" / f"{job}-rlhf"
    shutil.rmtree(out, ignore_errors=True)
    plugins = build_plugin_manager()

    class Hook:
        @rlhf.hookimpl
        def on_step_end(self, run: Any, step: int, metrics: dict[str, Any]) -> None:
            if spec["kind"] == "grpo":
                rollout = GRPO["prompts"] * GRPO["n"]
                trained = rollout * (1.0 - metrics.get("policy/zero_advantage_frac", 0.0))
                tokens = metrics["response/length_mean"] * rollout
                clock.stamp(samples=rollout, generated_tokens=tokens, trained_samples=trained,
                            trained_tokens=tokens * trained / rollout)
            else:
                clock.stamp()  # rows and loss tokens: counted around the objective's loss (below)

    plugins.register(Hook(), name="benchmark_clock")
    if spec["kind"] == "grpo":
        from rlhf.runtime.config.train_config import TrainConfig
        from rlhf.runtime.rl.local import train

        config = TrainConfig.from_dict(dict(
            model=str(files["model"]), data=[str(files["data"])], reward=[f"{files['reward']}:{GRPO['reward']}"],
            algo="grpo", kl_coef=0.0, loss_agg="token_mean", prompts_per_step=GRPO["prompts"], n_samples=GRPO["n"],
            max_new_tokens=GRPO["max_new_tokens"], micro_batch_size=GRPO["micro_batch_size"], steps=steps,
            lr=GRPO["lr"], adam_betas="0.9,0.95", weight_decay=0.0, max_grad_norm=1.0, lr_scheduler="constant",
            clip_low=0.2, clip_high=0.2, temperature=1.0, top_p=1.0, out=str(out), progress=False, seed=SEED,
            cpu_linear=args.cpu_linear, threads=1, dtype=args.dtype, **({"lora_rank": GRPO["lora_rank"]} if GRPO["lora_rank"] else {})))
        clock.start()
        train(config, plugins=plugins)
    else:
        from rlhf.cli.main import make_cli

        if spec["kind"] == "sft":
            from rlhf.plugins.objectives.sft import SFTObjective as objective_class
        else:
            from rlhf.plugins.objectives.dpo import DPOObjective as objective_class
        loss = objective_class.loss

        def counted_loss(self: Any, models: Any, batch: dict[str, Any], stats: Any) -> Any:
            rows = len(batch["input_ids"]) // (2 if spec["kind"] == "dpo" else 1)
            clock.count(samples=rows, trained_tokens=float(batch["loss_mask"][:, 1:].sum()))
            return loss(self, models, batch, stats)

        objective_class.loss = counted_loss
        task = (["sft", "--output-key", "completion"] if spec["kind"] == "sft"
                else ["dpo", "--beta", str(OFFLINE["beta"])])
        clock.start()
        make_cli(plugins)(args=task + [
            "--model", str(files["model"]), "--data", str(files["data"]),
            "--batch-size", str(OFFLINE["batch_size"]), "--micro-batch-size", str(OFFLINE["micro_batch_size"]),
            "--steps", str(steps), "--lr", str(OFFLINE["lr"]), "--adam-betas", "0.9,0.95", "--weight-decay", "0",
            "--max-grad-norm", "1.0", "--lr-scheduler", "constant", "--out", str(out), "--no-progress",
            "--seed", str(SEED), "--cpu-linear", args.cpu_linear, "--threads", "1", "--dtype", args.dtype]
            + (["--packing"] if spec.get("packing") else []), standalone_mode=False)
    return {"kernels": benchlib.cpu_linear_line(args.cpu_linear), "rlhf_from": str(Path(rlhf.__file__).parents[1])}


# ---------------------------------------------------------------------------------------------- TRL

def run_trl(job: str, root: Path, steps: int, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    import importlib.util

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    spec, files = JOBS[job], job_files(root, job)
    out = root / "runs" / f"{job}-trl"
    shutil.rmtree(out, ignore_errors=True)

    class Stamp(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            clock.start()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            clock.stamp()

    bf16 = args.dtype == "bf16"  # the weights loaded in bfloat16, and the Trainer's bf16 (autocast on a CPU)
    common = dict(output_dir=str(out), use_cpu=True, bf16=bf16, fp16=False, gradient_checkpointing=False,
                  max_steps=steps, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95,
                  weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to="none", save_strategy="no",
                  disable_tqdm=True, seed=SEED, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch_dtype(args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(files["model"])
    if spec["kind"] == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        source = importlib.util.spec_from_file_location("bench_reward", files["reward"])
        reward_module = importlib.util.module_from_spec(source)
        source.loader.exec_module(reward_module)
        rollout = GRPO["prompts"] * GRPO["n"]
        config = GRPOConfig(**common, learning_rate=GRPO["lr"], per_device_train_batch_size=GRPO["micro_batch_size"],
                            gradient_accumulation_steps=rollout // GRPO["micro_batch_size"], num_generations=GRPO["n"],
                            max_completion_length=GRPO["max_new_tokens"], beta=0.0, loss_type="dapo", epsilon=0.2,
                            num_iterations=1, temperature=1.0, top_p=1.0, top_k=0)
        prompts = [json.loads(line) for line in files["data"].read_text().splitlines()]
        trainer_class = GRPOTrainer
        kwargs = dict(reward_funcs=getattr(reward_module, GRPO["reward"]), train_dataset=Dataset.from_list(prompts))
        if GRPO["lora_rank"]:  # rlhf's LoRA: every linear layer but the output head, alpha 16, no dropout
            from peft import LoraConfig

            kwargs["peft_config"] = LoraConfig(r=GRPO["lora_rank"], lora_alpha=16, lora_dropout=0.0,
                                               target_modules="all-linear", task_type="CAUSAL_LM")
    else:
        rows = [json.loads(line) for line in files["data"].read_text().splitlines()]
        order = [i for step in json.loads(files["order"].read_text()) for i in step]
        if spec["kind"] == "sft":
            from trl import SFTConfig as config_class
            from trl import SFTTrainer as trainer_class
            extra = dict(completion_only_loss=True, padding_free=bool(spec.get("packing")),
                         max_length=None if spec.get("packing") else 1024)
        else:
            from trl import DPOConfig as config_class
            from trl import DPOTrainer as trainer_class
            extra = dict(beta=OFFLINE["beta"], loss_type="sigmoid", max_length=1024)
        config = config_class(**common, **extra, learning_rate=OFFLINE["lr"],
                              per_device_train_batch_size=OFFLINE["micro_batch_size"],
                              gradient_accumulation_steps=OFFLINE["batch_size"] // OFFLINE["micro_batch_size"])
        kwargs = dict(train_dataset=Dataset.from_list([rows[i] for i in order]))  # rlhf's step order, unshuffled

    class Counted(trainer_class):  # type: ignore[misc, valid-type]
        def _get_train_sampler(self, *a: Any, **k: Any) -> Any:
            if spec["kind"] == "grpo":
                return super()._get_train_sampler(*a, **k)
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model: Any, inputs: dict[str, Any], *a: Any, **k: Any) -> Any:
            if spec["kind"] == "grpo":
                mask = inputs["completion_mask"]
                clock.count(trained_samples=mask.shape[0], trained_tokens=float(mask.sum()))
            elif spec["kind"] == "sft":
                labels = inputs["labels"]
                rows = (int((inputs["position_ids"] == 0).sum()) if spec.get("packing") and "position_ids" in inputs
                        else labels.shape[0])
                clock.count(samples=rows, trained_tokens=float((labels[:, 1:] != -100).sum()))
            else:
                mask = inputs["completion_mask"]
                clock.count(samples=mask.shape[0] // 2, trained_tokens=float(mask.sum()))
            return super().compute_loss(model, inputs, *a, **k)

    class StampGenerated(Stamp):
        def on_log(self, _a: Any, _s: Any, _c: Any, logs: dict[str, Any] | None = None, **__: Any) -> None:
            if logs and "completions/mean_length" in logs and clock.work:
                rollout = GRPO["prompts"] * GRPO["n"]
                clock.work[-1]["generated_tokens"] = logs["completions/mean_length"] * rollout
                clock.work[-1]["samples"] = rollout

    trainer = Counted(model=model, args=config, processing_class=tokenizer, callbacks=[StampGenerated()], **kwargs)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.train()
    return {"kernels": "torch default (MKL on x86)"}


# ---------------------------------------------------------------------------------------------- floor

def torch_dtype(name: str) -> Any:
    """The weights' dtype for ``--dtype`` (fp32, bf16)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def resident_mb() -> float:
    """This process's resident set now (``VmRSS``), MB; the peak so far where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def training_state_floor(model: Any, libraries_mb: float, frozen: Any = None) -> dict[str, float]:
    """The resident set a training run of this job cannot go below: the libraries (torch and
    transformers imported), the job's weights as loaded and read (a DPO reference included), and a gradient
    and AdamW's two moments per trainable parameter, allocated and written here, then freed
    (``state_floor_mb``); the libraries alone (``libraries_mb``). Taken before any step."""
    import torch

    with torch.no_grad():  # weights loaded from a mapped file are resident once read: read every one
        for net in (model, frozen) if frozen is not None else (model,):
            for tensor in (*net.parameters(), *net.buffers()):
                tensor.sum()
    weights_mb = resident_mb()
    held = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad for _ in range(3)]  # grad, m, v
    floor = resident_mb()
    del held
    return {"state_floor_mb": floor, "libraries_mb": libraries_mb, "weights_loaded_mb": weights_mb}


def run_floor(job: str, root: Path, steps: int, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """The bare model work of the job's step in plain torch + the model's own forward (no framework)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec, files = JOBS[job], job_files(root, job)
    if GRPO["lora_rank"]:
        raise SystemExit("the floor has no LoRA variant: leave the floor out of LoRA points")
    libraries_mb = resident_mb()
    model = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch_dtype(args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(files["model"])
    reference = (AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch_dtype(args.dtype))
                 .eval().requires_grad_(False) if spec["kind"] == "dpo" else None)
    state = training_state_floor(model, libraries_mb, frozen=reference)
    lr = GRPO["lr"] if spec["kind"] == "grpo" else OFFLINE["lr"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    torch.manual_seed(SEED)

    def token_logprobs(net: Any, ids: Any, mask: Any, keep: int) -> Any:
        """(b, keep) log-probs of the last ``keep`` tokens of ``ids`` (b, T)."""
        logits = net(input_ids=ids, attention_mask=mask, logits_to_keep=keep + 1).logits[:, :-1]  # (b, keep, V)
        return logits.log_softmax(-1).gather(-1, ids[:, -keep:, None]).squeeze(-1)  # (b, keep)

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    clock.start()
    if spec["kind"] == "grpo":
        prompts = [json.loads(line)["prompt"] for line in files["data"].read_text().splitlines()]
        pad = tokenizer.pad_token_id
        mb, new = GRPO["micro_batch_size"], GRPO["max_new_tokens"]
        for step in range(steps):
            group = [tokenizer(prompts[(step * GRPO["prompts"] + i) % len(prompts)])["input_ids"]
                     for i in range(GRPO["prompts"])]
            rows = [ids for ids in group for _ in range(GRPO["n"])]
            width = max(map(len, rows))
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # (B, P) left padded
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # (B, P)
            model.eval()
            with torch.inference_mode():  # prefill, then one forward per new token over the KV cache
                positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=1)
                cache, logits, tokens = out.past_key_values, out.logits[:, -1], []
                for _ in range(new):
                    cdf = logits.float().softmax(-1).cumsum(-1)  # (B, V): inverse-CDF sampling, one uniform a row
                    token = torch.searchsorted(cdf, torch.rand(len(rows), 1) * cdf[:, -1:]).clamp(max=cdf.shape[1] - 1)
                    tokens.append(token)  # (B, 1)
                    mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                    positions = positions[:, -1:] + 1
                    out = model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache,
                                use_cache=True)
                    cache, logits = out.past_key_values, out.logits[:, -1]
            sequences = torch.cat([ids, *tokens], dim=1)  # (B, P + A)
            del cache, out
            model.train()
            advantages = torch.randn(len(rows), 1)  # (B, 1)
            trained = 0.0
            for i in range(0, len(rows), mb):
                logprobs = token_logprobs(model, sequences[i:i + mb], mask[i:i + mb], new)  # (b, A)
                ratio = torch.exp(logprobs - logprobs.detach())  # on-policy: old log-probs are these
                loss = -(ratio * advantages[i:i + mb]).sum() / (len(rows) * new)  # token mean over the rollout
                loss.backward()
                trained += logprobs.numel()
            optimizer_step()
            clock.stamp(samples=len(rows), generated_tokens=len(rows) * new, trained_samples=len(rows),
                        trained_tokens=trained)
        return {"kernels": "torch default (MKL on x86)", **state}

    rows = [json.loads(line) for line in files["data"].read_text().splitlines()]
    order = json.loads(files["order"].read_text())
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def encode(prompt: str, completion: str) -> tuple[list[int], int]:
        p = tokenizer(prompt)["input_ids"]
        return p + tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos], len(p)

    def padded(seqs: list[tuple[list[int], int]]) -> tuple[Any, Any, Any]:
        """Right-padded ids, attention mask and loss mask (1 on completion tokens) of (b, T)."""
        width = max(len(s) for s, _ in seqs)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s, _ in seqs])
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s, _ in seqs])
        loss = torch.tensor([[0] * p + [1] * (len(s) - p) + [0] * (width - len(s)) for s, p in seqs])
        return ids, attn, loss

    def sum_logprobs(net: Any, ids: Any, attn: Any, loss_mask: Any) -> tuple[Any, Any]:
        logits = net(input_ids=ids, attention_mask=attn).logits[:, :-1]  # (b, T-1, V)
        lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (b, T-1)
        return (lp * loss_mask[:, 1:]).sum(-1), loss_mask[:, 1:].sum()  # (b,), tokens

    mb = OFFLINE["micro_batch_size"]
    for step in range(steps):
        batch = [rows[i] for i in order[step]]
        trained = 0.0
        if spec["kind"] == "sft":
            seqs = sorted((encode(r["prompt"], r["completion"]) for r in batch), key=lambda s: len(s[0]))
            total = sum(len(s) - p for s, p in seqs)
            for i in range(0, len(seqs), mb):
                part = seqs[i:i + mb]
                if spec.get("packing"):  # one row, positions restarting per sequence (flash-attention style)
                    ids = torch.tensor([[t for s, _ in part for t in s]])  # (1, N)
                    positions = torch.tensor([[j for s, _ in part for j in range(len(s))]])  # (1, N)
                    loss_mask = torch.tensor([[int(j >= p) for s, p in part for j in range(len(s))]])  # (1, N)
                    starts = torch.tensor([[int(j == 0) for s, _ in part for j in range(len(s))]])  # (1, N)
                    logits = model(input_ids=ids, position_ids=positions).logits[:, :-1]  # (1, N-1, V)
                    lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (1, N-1)
                    keep = loss_mask[:, 1:] * (1 - starts[:, 1:])  # (1, N-1)
                    lp_sum, tokens = (lp * keep).sum(), keep.sum()
                else:
                    lp_sum, tokens = sum_logprobs(model, *padded(part))
                    lp_sum = lp_sum.sum()
                (-lp_sum / total).backward()
                trained += float(tokens)
            optimizer_step()
            clock.stamp(samples=len(batch), trained_tokens=trained)
            continue
        pairs = sorted(((encode(r["prompt"], r["chosen"]), encode(r["prompt"], r["rejected"])) for r in batch),
                       key=lambda pair: max(len(pair[0][0]), len(pair[1][0])))
        for i in range(0, len(pairs), mb):
            part = [c for c, _ in pairs[i:i + mb]] + [r for _, r in pairs[i:i + mb]]  # chosen rows, then rejected
            ids, attn, loss_mask = padded(part)
            with torch.no_grad():
                ref, _ = sum_logprobs(reference, ids, attn, loss_mask)  # (2b,)
            policy, tokens = sum_logprobs(model, ids, attn, loss_mask)  # (2b,)
            half = len(part) // 2
            margin = OFFLINE["beta"] * ((policy[:half] - ref[:half]) - (policy[half:] - ref[half:]))  # (b,)
            (-torch.nn.functional.logsigmoid(margin).sum() / len(pairs)).backward()
            trained += float(tokens)
        optimizer_step()
        clock.stamp(samples=len(batch), trained_tokens=trained)
    return {"kernels": "torch default (MKL on x86)", **state}


# ---------------------------------------------------------------------------------------------- main

def apply_overrides(text: str) -> None:
    """``model=NAME`` for every GRPO job; the other keys change `GRPO` (integers)."""
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key == "model":
            for spec in JOBS.values():
                if spec["kind"] == "grpo":
                    spec["model"] = value
        elif key in GRPO and key not in ("reward", "lr"):
            GRPO[key] = int(value)
        else:
            raise SystemExit(f"--set: unknown key {key!r} (model, prompts, n, max_new_tokens, micro_batch_size, "
                             "lora_rank)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare", "run"])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--jobs", default=",".join(JOBS))
    parser.add_argument("--job", choices=list(JOBS))
    parser.add_argument("--side", choices=["rlhf", "trl", "floor"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--cpu-linear", default="torch", choices=["auto", "torch", "onednn"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                        help="the weights' dtype on every side (TRL: loaded so, and its Trainer's bf16=True)")
    parser.add_argument("--set", default="", help="GRPO shape overrides, e.g. model=small4k,n=8,max_new_tokens=512,"
                                                  "prompts=2,micro_batch_size=8,lora_rank=16")
    parser.add_argument("--out")
    args = parser.parse_args()
    root = Path(args.work_dir)
    apply_overrides(args.set)
    if args.command == "prepare":
        jobs = args.jobs.split(",")
        if GRPO["prompts"] * GRPO["n"] % GRPO["micro_batch_size"]:
            raise SystemExit("micro_batch_size must divide prompts x n")
        prepare(root, jobs, {job: args.steps or JOBS[job]["steps"] for job in jobs})
        return
    threads = benchlib.setup_environment(1)
    clock = Clock()
    load_start = os.getloadavg()
    run = {"rlhf": run_rlhf, "trl": run_trl, "floor": run_floor}[args.side]
    info = run(args.job, root, args.steps or JOBS[args.job]["steps"], args, clock)
    foreign = {"rlhf": "trl", "trl": "rlhf", "floor": "trl"}[args.side]
    imported = sorted(m for m in (foreign, "rlhf" if args.side == "floor" else foreign) if m in sys.modules)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = dict(
        side=args.side, job=args.job, threads=threads, cpu=[b - a for a, b in zip(clock.cpu, clock.cpu[1:])],
        wall=[b - a for a, b in zip(clock.wall, clock.wall[1:])], work=clock.work,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        children_cpu=children.ru_utime + children.ru_stime, load=[load_start, os.getloadavg()],
        versions=benchlib.versions() if args.side != "trl" else {k: v for k, v in benchlib.versions().items()
                                                                   if k != "rlhf-core"},
        mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"), dtype=args.dtype,
        kernel_caches=os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "oneDNN default"),
        foreign_imports=imported, **info)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
