"""Ring attention (``--ring-attn-size``): the attention function and `RingModel` on two ranks
(torchrun, gloo) against plain attention and the one-process model, values and gradients,
padded and packed (ring_check.py computes both sides)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf.core.distributed import DistContext
from rlhf.core.errors import ConfigError
from tests.helpers import torchrun

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ring_results(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ring") / "results.pt"
    torchrun(2, str(HERE / "ring_check.py"), str(tiny_model_dir), str(out), timeout=300)
    return torch.load(out, weights_only=False)


@pytest.mark.cluster
@pytest.mark.parametrize("case", ["attention/padded/stride1", "attention/padded/stride2", "attention/packed"])
def test_ring_attention_equals_plain_causal_attention_values_and_gradients(ring_results, case):
    """Each rank's queries over the whole rows' keys (gathered), causal within each sequence: the
    outputs of its columns and the gradients of its queries, keys and values (the keys' and values'
    summed over the ring) are plain attention's."""
    results = ring_results[case]
    assert set(results) == {"out", "grad_q", "grad_k", "grad_v"}
    for name, (expected, got) in results.items():
        assert expected.abs().max() > 0.1, name  # not a comparison of zeros
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()), msg=name)


@pytest.mark.cluster
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_ring_model_gives_the_one_process_logprobs_outputs_and_gradients(ring_results, layout):
    """Right-, left- and unpadded rows of odd length (padded to a multiple of the ring), packed or
    not: log-probs, entropy and the called model's logits equal the one-process forward's, and the
    parameter gradients summed over the ring equal the one-process gradient (1e-5 relative)."""
    results = ring_results[f"model/{layout}"]
    for name in ("logprobs", "entropy", "call"):
        expected, got = results[name]
        assert expected.abs().max() > 0.1, name
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()), msg=name)
    expected, got = results["grads"]
    assert expected.keys() == got.keys()
    for name, grad in expected.items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.unit
def test_ring_size_must_divide_the_number_of_processes():
    with pytest.raises(ConfigError, match="--ring-attn-size 2 needs a number of processes that it divides"):
        DistContext(rank=0, world_size=3).with_rings(2)
    assert DistContext().with_rings(1) == DistContext()  # no ring: the context itself


@pytest.mark.unit
def test_data_parallel_ranks_under_rings():
    """Ranks 0-1 and 2-3 are two rings of two: two data-parallel ranks, ring peers shard alike."""
    from rlhf.core.distributed import RingGroup

    contexts = [DistContext(rank=r, world_size=4, ring=RingGroup(size=2, rank=r % 2)) for r in range(4)]
    assert [(c.dp_rank, c.dp_size) for c in contexts] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [c.shard(list(range(5))) for c in contexts] == [[0, 2, 4], [0, 2, 4], [1, 3], [1, 3]]


@pytest.mark.unit
@pytest.mark.parametrize("extra,message", [
    (["--ring-attn-size", "2"], "--ring-attn-size 2 needs a number of processes that it divides (this run has 1)"),
    (["--ring-attn-size", "0"], "--ring-attn-size must be a whole number of at least 1; got 0"),
    (["--ring-attn-size", "2", "--ring-head-stride", "0"], "--ring-head-stride must be a whole number of at least 1"),
])
@pytest.mark.parametrize("command", ["sft", "train"])
def test_ring_options_the_run_cannot_use_are_one_line_errors(command, extra, message, tiny_model_dir, task, fit_data,
                                                             tmp_path):
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from tests.helpers import run_cli

    args = {"sft": ["sft", "--data", str(fit_data / "sft.jsonl")],
            "train": ["train", "--data", str(task / "data.jsonl"), "--label-key", "answer", "--reward",
                      str(task / "rewards.py")]}[command]
    result = run_cli(build_plugin_manager(load_entrypoints=False),
                     args + ["--model", str(tiny_model_dir), "--out", str(tmp_path / "run"), "--no-progress", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # refused before the run starts


@pytest.mark.unit
def test_ring_attention_with_async_generation_is_refused(tiny_model_dir, task, tmp_path):
    from tests.helpers import small_config

    with pytest.raises(ConfigError, match="--ring-attn-size does not work with --async yet"):
        small_config(tiny_model_dir, task, tmp_path / "run", ring_attn_size=2, async_rollout=True).derived()
