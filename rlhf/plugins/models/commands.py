"""``rlhf merge-lora``: turn a LoRA adapter saved by a run into a plain Hugging Face model.

A command of the models plugin (``register_commands``): the LoRA code it runs is this plugin's.
"""

from __future__ import annotations

from pathlib import Path

import click

DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32")


@click.command("merge-lora", short_help="Merge a LoRA adapter into its base model.")
@click.argument("adapter_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--base", default=None, metavar="MODEL",
              help="Base model directory or hub name (default: the adapter's base_model_name_or_path)")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Directory for the merged model and its tokenizer")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto", show_default=True,
              help="Dtype to load the base in and save (auto: the checkpoint's own)")
@click.option("--trust-remote-code", is_flag=True, help="Allow model code from the checkpoint (only if you trust it)")
def merge_lora_command(adapter_dir: Path, base: str | None, out_dir: Path, dtype: str, trust_remote_code: bool) -> None:
    """Merge a LoRA adapter (ADAPTER_DIR, e.g. <run>/final) into its base model: W + (α/r)·B·A.

    The result loads with AutoModelForCausalLM.from_pretrained and vLLM, without peft.
    """
    from rlhf.api import ConfigError, check_model_ref

    if out_dir.exists() and any(out_dir.iterdir()):  # these two before torch and transformers load
        raise ConfigError(f"--out {out_dir} is not empty; choose a new directory")
    if base is not None:
        try:
            check_model_ref(base)
        except ConfigError as exc:
            raise ConfigError(f"--base {exc}") from None
    from transformers.utils import logging as hf_logging

    from rlhf.plugins.models.loading import DTYPES
    from rlhf.plugins.models.lora import merge_lora

    hf_logging.disable_progress_bar()  # loading and writing bars: a one-line command says one line
    merge_lora(adapter_dir, out_dir, base=base, dtype=DTYPES.get(dtype, "auto"), trust_remote_code=trust_remote_code)
    click.echo(f"merged model written to {out_dir}")
