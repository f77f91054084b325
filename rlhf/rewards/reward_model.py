"""Reward models: a transformer whose linear head, read at the last real token, scores a text.

Two checkpoint layouts load:

* a Hugging Face ``*ForSequenceClassification`` directory with one label (TRL's reward models);
* OpenRLHF's layout (``models/model.py::get_llm_for_sequence_regression``): the base transformer
  under its ``base_model_prefix`` plus ``nn.Linear(hidden, 1, bias=False)`` saved under
  ``value_head_prefix`` (default ``score``; ``value_head_prefix`` in config.json wins). The base
  loads with ``AutoModel`` and the head weight is read from the checkpoint files.

Both are scored the same way, as OpenRLHF does: position ids are ``cumsum(attention_mask) - 1``, the
head runs on every position, and the reward is the value at the last position whose attention mask
is 1, so left and right padding give the same result. A sequence-classification model whose head
is not a one-output linear ``score`` (encoders that pool a [CLS] token) uses its own forward.
Texts are tokenized without adding special tokens (the prompt text already carries its template),
like OpenRLHF's ``serve_rm``. Conventions the model was trained with are read from its config.json
(``rlhf rm`` writes them) and can be forced on with options: ``reward_append_eos: true`` appends
the EOS token to each text (``--reward-rm-append-eos``); ``normalize_reward: true`` with ``mean``
and ``std`` scores ``(r - mean) / std`` (OpenRLHF's keys; ``--reward-rm-normalize``).

Shape legend: ``B`` texts in a forward batch, ``T`` tokens, ``H`` hidden size.

`RewardModelWorker` is a plain class with ``score(texts) -> list[float]``, so the Ray runtime can
host it as an actor and hand `RewardModelSource` the actor's handle instead.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlhf.core.checkpoints import MissingWeightsError, read_weight, top_level_weights
from rlhf.core.modeling import reading_weights, resolve_device
from rlhf.rewards.failures import RewardConfigError
from rlhf.rewards.options import RewardOptions
from rlhf.rewards.source import RewardBatch, RewardSource, SourceOutput


def is_model_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def load_checkpoint_tensor(path: Path, key: str) -> Any:
    """One tensor from a checkpoint directory (safetensors, sharded or not, or pytorch_model.bin)."""
    try:
        tensor = read_weight(path, key)
        if tensor is not None:
            return tensor
        heads = top_level_weights(path)
    except MissingWeightsError as exc:
        raise RewardConfigError(str(exc)) from None
    raise RewardConfigError(f"{path} has no weight {key!r}; top-level weights there: {', '.join(heads) or 'none'}. "
                            "Pass --reward-value-head-prefix NAME for a head saved as NAME.weight.")


class RewardModelWorker:
    """Loads a reward model on first use and scores texts in batches."""

    def __init__(self, path: str | Path, options: RewardOptions | None = None):
        self.path = Path(path)
        self.options = options or RewardOptions()
        self.model: Any = None
        self.offload = False  # --offload-ref-reward: the model leaves the device after each score
        self.away: Any = None

    def load(self) -> None:
        if self.model is not None:
            return
        import torch
        from torch import nn
        from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

        opts = self.options
        self.device = resolve_device(opts.rm_device, flag="--reward-rm-device")
        dtype_name = opts.rm_dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if self.device.type == "cuda" else "float32"
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise RewardConfigError(f"unknown reward model dtype {opts.rm_dtype!r}; "
                                    "use auto, float32, bfloat16 or float16")
        config = AutoConfig.from_pretrained(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.truncation_side = "left"  # keep the end, where the score is read
        prefix = getattr(config, "value_head_prefix", None) or opts.value_head_prefix
        classifier = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
        self.head: Any = None
        if classifier and not getattr(config, "value_head_prefix", None):
            with reading_weights(str(self.path)):
                model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=dtype)
            if model.config.num_labels != 1:
                raise RewardConfigError(f"{self.path} is a classifier with {model.config.num_labels} labels; "
                                        "a reward model has exactly one")
            head = getattr(model, "score", None)
            if isinstance(head, nn.Linear) and head.out_features == 1:
                self.base, self.head = getattr(model, model.base_model_prefix), head
        else:
            with reading_weights(str(self.path)):
                model = AutoModel.from_pretrained(self.path, dtype=dtype)
                weight = load_checkpoint_tensor(self.path, f"{prefix}.weight")
            hidden = model.config.hidden_size
            if tuple(weight.shape) != (1, hidden):
                raise RewardConfigError(f"{self.path}: {prefix}.weight has shape {tuple(weight.shape)}, "
                                        f"expected (1, {hidden})")
            self.head = nn.Linear(hidden, 1, bias=False, dtype=dtype)
            with torch.no_grad():
                self.head.weight.copy_(weight)
            self.base = model
            model = nn.ModuleDict({"base": model, "head": self.head})
        self.append_eos = opts.rm_append_eos or bool(getattr(config, "reward_append_eos", False))
        self.mean, self.std = 0.0, 1.0
        if opts.rm_normalize or bool(getattr(config, "normalize_reward", False)):
            if not hasattr(config, "mean") or not hasattr(config, "std"):
                raise RewardConfigError(f"{self.path}/config.json has no mean and std to normalize rewards with")
            self.mean, self.std = float(config.mean), max(float(config.std), 1e-8)
        self.model = model.to(self.device).eval()
        if self.device.type == "cpu":
            from rlhf.fastpaths.cpu_linear import use_onednn_linears

            use_onednn_linears(self.model)

    def score(self, texts: list[str]) -> list[float]:
        """One reward per text."""
        self.load()
        if not self.offload:
            return self._score(texts)
        from rlhf.core.offload import ModuleOffload

        self.away = self.away or ModuleOffload(self.model)
        with self.away.in_use():
            return self._score(texts)

    def _score(self, texts: list[str]) -> list[float]:
        import torch

        opts = self.options
        eos = (self.tokenizer.eos_token or "") if self.append_eos else ""
        rewards: list[float] = []
        for start in range(0, len(texts), opts.rm_batch_size):
            chunk = [t + eos for t in texts[start:start + opts.rm_batch_size]]
            encoded = self.tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False,
                                     truncation=opts.rm_max_length is not None, max_length=opts.rm_max_length)
            input_ids = encoded["input_ids"].to(self.device)  # (B, T)
            attention_mask = encoded["attention_mask"].to(self.device)  # (B, T)
            assert bool((attention_mask.sum(1) > 0).all()), "a text has no tokens; the reward model cannot score it"
            with torch.no_grad():
                reward = self.forward(input_ids, attention_mask)  # (B,)
            rewards.extend(((reward.float() - self.mean) / self.std).tolist())
        return rewards

    def forward(self, input_ids: Any, attention_mask: Any) -> Any:
        """Rewards ``(B,)`` for token ids ``(B, T)`` with any padding."""
        from rlhf.core.masked import last_real_index

        if self.head is None:  # a classifier with its own pooling
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]  # (B,)
        mask = attention_mask.long()  # (B, T)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids).last_hidden_state  # (B, T, H)
        values = self.head(hidden).squeeze(-1)  # (B, T)
        last = last_real_index(mask)  # (B,)
        return values.gather(1, last[:, None]).squeeze(1)  # (B,)


class RewardModelSource(RewardSource):
    """Scores ``queries`` (prompt text + completion) with a reward model worker."""

    kind = "model"

    def __init__(self, path: str | Path, name: str, options: RewardOptions | None = None, worker: Any = None):
        super().__init__(name, str(path), options)
        self.worker = worker if worker is not None else RewardModelWorker(path, self.options)

    @property
    def inline(self) -> bool:
        return True

    def offload_between_uses(self) -> None:
        """The model loads on first use and leaves the device after every score (a worker hosted
        elsewhere manages its own memory)."""
        if isinstance(self.worker, RewardModelWorker):
            self.worker.offload = True

    def _score_inline(self, batch: RewardBatch) -> SourceOutput:
        import traceback

        n = len(batch)
        try:
            values = list(self.worker.score(batch.queries))
            assert len(values) == n, f"the reward model returned {len(values)} scores for {n} texts"
        except RewardConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failure for every sample; the policy decides
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            return self.fail_all(batch, "exception", f"{type(exc).__name__}: {exc}", tb)
        output = SourceOutput(values=[None] * n)
        for i, value in enumerate(values):
            if math.isfinite(value):
                output.values[i] = float(value)
            else:
                output.failures[i] = self.failure(batch, i, "not finite", f"the reward model scored {value}")
        return output
