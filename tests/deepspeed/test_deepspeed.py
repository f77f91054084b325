"""The ``deepspeed`` backend on CPU (gloo): every ZeRO stage gives the ``torch`` backend's updates,
two processes give one process's update, ZeRO-3 runs, checkpoints, resumes and exports a
consolidated model under torchrun, and a dropped accumulation leaves no trace.

Tolerances. Both backends run the same float32 math in a different order: DeepSpeed flattens
parameters into partitions, ZeRO-3 accumulates norms in float64, and gloo sums ranks. Gradients
therefore agree to ~1e-7 relative: losses and gradient norms are compared at relative 1e-5
(measured: at most 1e-6), rewards and sampled tokens exactly. Adam's first steps are
``lr * g / (|g| + eps)``: an element whose gradient is near ``eps`` moves by a visible fraction of
``lr`` when ``g`` changes by 1e-7, so weights are compared with ``atol = lr / 100`` (measured: at
most lr / 600 after 8 optimizer steps; one element at lr / 450 in a ZeRO-3 run at lr 1e-2).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.rl.local import train
from tests.helpers import backend_full_weights, backend_micro_loss, read_jsonl, run_cli, torchrun

pytestmark = [pytest.mark.cluster, pytest.mark.deepspeed]
HERE = Path(__file__).parent
LR = 1e-3
CPU_ADAM_BUILD_S = 300


def run_values(model_dir, task, out, **overrides):
    """2 steps x (2 epochs x 2 minibatches) = 8 optimizer steps of 2 micro-batches, a warmup and a cosine decay.
    The full logits on every side: ZeRO-3 partitions the output layer, which then takes them (vocab
    chunks need the whole weight), and the runs compared must round alike to sample alike."""
    values = dict(model=str(model_dir), data=[str(task / "data.jsonl")], label_key="answer",
                  reward=[str(task / "rewards.py")], prompts_per_step=2, n_samples=4, max_new_tokens=6,
                  micro_batch_size=2, train_batch_size=4, ppo_epochs=2, steps=2, lr=LR, warmup_ratio=0.25,
                  lr_scheduler="cosine", out=str(out), progress=False, seed=7, vocab_chunks=False)
    values.update(overrides)
    return values


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(run / "final").state_dict()


def assert_same_run(got: Path, expected: Path, keys=("policy/loss", "policy/grad_norm", "policy/lr")) -> None:
    """Same samples, same losses and gradient norms, same LR, same final weights (see the tolerances above)."""
    got_metrics, expected_metrics = read_jsonl(got / "metrics.jsonl"), read_jsonl(expected / "metrics.jsonl")
    assert [m["step"] for m in got_metrics] == [m["step"] for m in expected_metrics]
    for mine, theirs in zip(got_metrics, expected_metrics):
        assert mine["reward/mean"] == theirs["reward/mean"], mine["step"]
        for key in keys:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-9), (mine["step"], key)
    completions = [s["completion"] for s in read_jsonl(got / "samples.jsonl")]
    assert completions == [s["completion"] for s in read_jsonl(expected / "samples.jsonl")]
    got_weights, expected_weights = final_weights(got), final_weights(expected)
    for name, weight in expected_weights.items():
        assert torch.allclose(got_weights[name], weight, rtol=0, atol=LR / 100), name
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(yaml.safe_load((got / "config.yaml").read_text())["model"])
    moved = max(float((got_weights[n] - w).abs().max()) for n, w in initial.state_dict().items())
    assert moved > LR, "the weights barely moved: the comparison above would prove nothing"


@pytest.fixture(scope="module")
def torch_run(tiny_model_dir, task, tmp_path_factory):
    """The reference: the same run with the torch backend."""
    root = tmp_path_factory.mktemp("torch")
    return train(TrainConfig.from_dict(run_values(tiny_model_dir, task, root / "run")))


@pytest.mark.parametrize("stage, options", [(0, {}), (1, {}), (2, {}), (3, {"offload_params": True})],
                         ids=["zero0", "zero1", "zero2", "zero3-offload-params"])
def test_each_zero_stage_trains_like_the_torch_backend(tiny_model_dir, task, tmp_path, torch_run, stage, options):
    out = train(TrainConfig.from_dict(run_values(tiny_model_dir, task, tmp_path / "run", backend="deepspeed",
                                                 zero_stage=stage, **options)))
    assert_same_run(out, torch_run)
    assert (out / "checkpoints" / "step_2" / "policy" / "deepspeed").is_dir()  # DeepSpeed's own checkpoint


def test_zero2_with_vocab_chunks_trains_like_the_torch_backend_with_them(tiny_model_dir, task, tmp_path,
                                                                        monkeypatch):
    """The output layer's gradient from vocabulary tiles reaches ZeRO-2's gradient partitions as the
    torch backend's optimizer gets it."""
    import rlhf.fastpaths.vocab_chunks as vocab_chunks

    calls = []
    real = vocab_chunks._ChunkedLogprobs.apply
    monkeypatch.setattr(vocab_chunks._ChunkedLogprobs, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(vocab_chunks, "FULL_LOGITS_UP_TO", 0)  # tiles in the training forwards too
    expected = train(TrainConfig.from_dict(run_values(tiny_model_dir, task, tmp_path / "torch", vocab_chunks=True)))
    got = train(TrainConfig.from_dict(run_values(tiny_model_dir, task, tmp_path / "ds", vocab_chunks=True,
                                                 backend="deepspeed", zero_stage=2)))
    assert calls
    assert_same_run(got, expected)


def test_rlhf_train_cli_with_zero3_in_one_process_matches_torch(tiny_model_dir, task, tmp_path, torch_run, plugins,
                                                                recwarn):
    args = ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", str(task / "rewards.py"), "--prompts-per-step", "2", "--n-samples", "4",
            "--max-new-tokens", "6", "--micro-batch-size", "2", "--train-batch-size", "4", "--ppo-epochs", "2",
            "--steps", "2", "--lr", str(LR), "--warmup-ratio", "0.25", "--lr-scheduler", "cosine", "--seed", "7",
            "--no-progress",
            "--out", str(tmp_path / "run"), "--backend", "deepspeed", "--zero-stage", "3"]
    result = run_cli(plugins, args)
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["components"]["backend"]["zero_stage"] == 3
    assert_same_run(tmp_path / "run", torch_run)
    deprecated = [str(w.message) for w in recwarn if "torch.distributed" in str(w.message)]
    assert not deprecated, deprecated  # torch's deprecation notes on DeepSpeed's collectives, once per step


def test_the_first_cpu_adam_build_is_announced(tmp_path, monkeypatch, caplog):
    from rlhf.plugins.backends.deepspeed_backend import announce_cpu_adam_build, log

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr("deepspeed.git_version_info.installed_ops", {"cpu_adam": False})
    announce_cpu_adam_build(log)
    assert "building DeepSpeed's CPU Adam op (first use on this machine" in caplog.text
    caplog.clear()
    (tmp_path / "cpu_adam").mkdir(exist_ok=True)
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    announce_cpu_adam_build(log)  # built before: nothing to say
    assert "CPU Adam" not in caplog.text


def test_ppo_critic_trains_and_exports_under_zero3(tiny_model_dir, task, tmp_path):
    """The critic's forwards go through the engine too, and --save-critic gathers its ZeRO-3 shards."""
    common = dict(algo="ppo", steps=1, save_critic=True, critic_lr=LR)
    expected = train(TrainConfig.from_dict(run_values(tiny_model_dir, task, tmp_path / "torch", **common)))
    got = train(TrainConfig.from_dict(run_values(tiny_model_dir, task, tmp_path / "ds", backend="deepspeed",
                                                 zero_stage=3, **common)))
    assert_same_run(got, expected, keys=("policy/loss", "critic/loss", "critic/grad_norm", "policy/grad_norm"))
    from safetensors.torch import load_file

    critic = load_file(got / "critic" / "model.safetensors")
    reference = load_file(expected / "critic" / "model.safetensors")
    assert critic.keys() == reference.keys() and "score.weight" in critic
    for name, weight in reference.items():
        assert torch.allclose(critic[name], weight, rtol=0, atol=LR / 100), name


# --- the backend on its own -------------------------------------------------------------------


def make_backend(model_dir, stage, dtype=torch.float32, **options):
    from transformers import AutoModelForCausalLM

    from rlhf.plugins.backends.deepspeed_backend import DeepSpeedBackend, DeepSpeedConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model, DeepSpeedBackend(model, DeepSpeedConfig(lr=1e-2, zero_stage=stage, micro_batch_size=2,
                                                          warmup_steps=3, **options))


@pytest.mark.parametrize("stage, dtype", [(0, torch.float32), (1, torch.float32), (2, torch.float32),
                                          (3, torch.float32), (0, torch.bfloat16), (3, torch.bfloat16)])
def test_zero_grad_drops_a_partial_accumulation_without_a_trace(tiny_model_dir, stage, dtype):
    """A non-finite micro-batch loss ends a step after some backwards: zero_grad must leave the
    weights, the optimizer and the LR schedule exactly as if those backwards had never run."""
    dropped_model, dropped = make_backend(tiny_model_dir, stage, dtype)
    clean_model, clean = make_backend(tiny_model_dir, stage, dtype)
    dropped.backward(backend_micro_loss(dropped, 0))
    dropped.zero_grad()
    stats = []
    for step_seeds in ((1, 2), (3,)):
        for backend in (dropped, clean):
            for seed in step_seeds:
                backend.backward(backend_micro_loss(backend, seed))
        stats.append((dropped.step(), clean.step()))
    for got, expected in stats:
        assert got == expected
    assert [s[0]["lr"] for s in stats] == pytest.approx([1e-2 / 3, 2e-2 / 3])  # warmup: steps 1 and 2 of 3
    assert all(s[0]["skipped"] == 0.0 and s[0]["grad_norm"] > 0 for s in stats)
    got, expected = backend_full_weights(dropped_model, dropped), backend_full_weights(clean_model, clean)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_a_nan_gradient_skips_the_step_and_the_schedule(tiny_model_dir):
    model, backend = make_backend(tiny_model_dir, 2)
    before = backend_full_weights(model, backend)
    backend.backward(backend_micro_loss(backend, 0) * float("nan"))
    stats = backend.step()
    assert stats["skipped"] == 1.0 and not torch.isfinite(torch.tensor(stats["grad_norm"]))
    after = backend_full_weights(model, backend)
    assert all(torch.equal(before[n], after[n]) for n in before)
    backend.backward(backend_micro_loss(backend, 1))
    assert backend.step()["lr"] == pytest.approx(1e-2 / 3)  # still the first warmup step


def test_a_zero3_engine_reserves_memory_by_the_model_not_by_deepspeed_s_default_bucket(tiny_model_dir):
    """ZeRO-3 allocates its gradient bucket when the engine starts: at DeepSpeed's default 5e8
    elements that is 2 GB of address space for any model. Engines a process made add up (a test
    run once reached 13 GB in one worker and its forks then failed with ENOMEM); the bucket is
    sized by the model instead, and the values are the same (test_each_zero_stage_... above)."""
    def data_mb() -> float:  # the process's private address space, touched or not
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(fields["VmData"].split()[0]) / 1024

    make_backend(tiny_model_dir, 3)  # the first engine also loads DeepSpeed's own modules
    before = data_mb()
    model, backend = make_backend(tiny_model_dir, 3)
    elements = sum(p.ds_numel for p in model.parameters())
    grown = data_mb() - before
    assert grown < 200 + 16 * elements * 4 / 2**20, (grown, elements)  # 2 GB before the cap


def test_bad_options_are_config_errors(tiny_model_dir):
    from rlhf.core.errors import ConfigError

    for stage, options, words in ((0, {"offload_optimizer": True}, "--zero-stage 1, 2 or 3"),
                                  (2, {"offload_params": True}, "--zero-stage 3"),
                                  (4, {}, "0, 1, 2 or 3")):
        with pytest.raises(ConfigError, match=words):
            make_backend(tiny_model_dir, stage, **options)


def test_fp16_on_a_device_without_it_is_a_config_error(tiny_model_dir):
    from deepspeed.accelerator import get_accelerator

    from rlhf.core.errors import ConfigError

    if get_accelerator().is_fp16_supported():
        pytest.skip(f"{get_accelerator().device_name()} supports fp16")
    with pytest.raises(ConfigError, match="does not support torch.float16"):
        make_backend(tiny_model_dir, 2, torch.float16)


# --- several processes --------------------------------------------------------------------------


def test_two_processes_update_like_one_under_zero2_and_zero3(tiny_model_dir, tmp_path):
    script = str(HERE / "dp_fit.py")
    torchrun(1, script, str(tiny_model_dir), str(tmp_path / "one.pt"), "2,3")
    torchrun(2, script, str(tiny_model_dir), str(tmp_path / "two.pt"), "2,3")
    one = torch.load(tmp_path / "one.pt", weights_only=False)
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    for stage in (2, 3):
        assert torch.allclose(one[stage]["old"], two[stage]["old"], atol=1e-6), stage
        for key, value in one[stage]["metrics"].items():
            assert two[stage]["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (stage, key)
        for name, weight in one[stage]["weights"].items():  # lr 1e-2 here: atol = lr / 500
            assert torch.allclose(weight, two[stage]["weights"][name], rtol=0, atol=2e-5), (stage, name)


def test_rlhf_train_zero3_under_torchrun_resumes_and_exports_a_consolidated_model(tiny_model_dir, task, tmp_path):
    """Two processes: 2 steps with a checkpoint each, then --resume to 3; the same run with the torch
    backend, uninterrupted, is the reference; the final model is the checkpoint's consolidated weights."""
    args = ["-m", "rlhf", "train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
            "--label-key", "answer", "--reward", str(task / "rewards.py"), "--prompts-per-step", "4",
            "--n-samples", "2", "--max-new-tokens", "4", "--micro-batch-size", "2", "--lr", str(LR), "--no-progress"]
    zero3 = [*args, "--out", str(tmp_path / "zero3"), "--backend", "deepspeed", "--zero-stage", "3"]
    torchrun(2, *zero3, "--steps", "2", "--save-every", "1")
    shards = sorted(p.name for p in (tmp_path / "zero3" / "checkpoints" / "step_2" / "policy" / "deepspeed").iterdir())
    assert shards == [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")]
    torchrun(2, *zero3, "--steps", "3", "--resume", "--resume-override", "steps")
    torchrun(2, *args, "--out", str(tmp_path / "torch"), "--steps", "3")
    assert_same_run(tmp_path / "zero3", tmp_path / "torch", keys=("policy/loss", "policy/grad_norm"))

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    consolidated = get_fp32_state_dict_from_zero_checkpoint(
        str(tmp_path / "zero3" / "checkpoints" / "step_3" / "policy"), tag="deepspeed")
    exported = final_weights(tmp_path / "zero3")
    assert exported.keys() == consolidated.keys()
    assert all(torch.equal(exported[name], consolidated[name]) for name in exported)


# --- optimizer offload (DeepSpeedCPUAdam, a C++ op built on first use) ----------------------------


@pytest.fixture(scope="module")
def cpu_adam():
    """Build DeepSpeedCPUAdam's op into the session's TORCH_EXTENSIONS_DIR (30 s to 6 min of g++ on 2 cores,
    depending on load); skip where it cannot be built, or not within the build budget."""
    build = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
    try:
        result = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, timeout=CPU_ADAM_BUILD_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"building DeepSpeed's cpu_adam op took more than {CPU_ADAM_BUILD_S} s on this machine")
    if result.returncode != 0:
        pytest.skip(f"DeepSpeed's cpu_adam op cannot be built here: {result.stderr[-500:]}")


@pytest.mark.parametrize("stage, options", [(2, {}), (3, {"offload_params": True})],
                         ids=["zero2", "zero3-offload-params"])
def test_offload_optimizer_trains_like_the_torch_backend(tiny_model_dir, task, tmp_path, torch_run, cpu_adam,
                                                         stage, options):
    out = train(TrainConfig.from_dict(run_values(tiny_model_dir, task, tmp_path / "run", backend="deepspeed",
                                                 zero_stage=stage, offload_optimizer=True, **options)))
    assert_same_run(out, torch_run)
