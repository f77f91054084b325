"""--offload-train-state with the ``deepspeed`` backend on CPU: at every ZeRO stage, setting the
training state aside and bringing it back between steps (parameters too at stage 3) leaves the
training exactly as it was. On a CPU DeepSpeed's own move is host to host; what it frees on a GPU
is unverified here."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import backend_full_weights, backend_micro_loss

pytestmark = [pytest.mark.cluster, pytest.mark.deepspeed]


def make_backend(model_dir, stage):
    from transformers import AutoModelForCausalLM

    from rlhf.plugins.backends.deepspeed_backend import DeepSpeedBackend, DeepSpeedConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return model, DeepSpeedBackend(model, DeepSpeedConfig(lr=1e-2, zero_stage=stage, micro_batch_size=2))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_state_set_aside_between_steps_changes_nothing(tiny_model_dir, stage):
    pytest.importorskip("deepspeed")
    runs = [make_backend(tiny_model_dir, stage), make_backend(tiny_model_dir, stage)]
    stats = []
    for seed in range(3):
        for index, (_, backend) in enumerate(runs):
            if index == 1 and seed > 0:  # after a step: moments and master weights exist
                moved = backend.offload_state(params=stage == 3)
                if stage in (0, 3):  # the moments (and at stage 3 the fp32 master partitions) moved by us
                    assert moved > 0
                if stage > 0:  # DeepSpeed's own buffers, by DeepSpeed
                    assert backend.engine.optimizer.offloaded_states
                backend.reload_state()
                assert stage == 0 or not backend.engine.optimizer.offloaded_states
            backend.backward(backend_micro_loss(backend, seed))
            stats.append(backend.step())
    assert stats[0::2] == stats[1::2]
    got, expected = backend_full_weights(*runs[1]), backend_full_weights(*runs[0])
    assert all(torch.equal(got[name], expected[name]) for name in expected)
