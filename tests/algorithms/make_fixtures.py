"""The script that made the shipped reference fixtures (rlhf/algorithms/fixtures/*.json):

    python -m tests.algorithms.make_fixtures          # rewrite them
    python -m tests.algorithms.make_fixtures --check  # exit 1 when the shipped files differ from a fresh run
                                                      # (numbers beyond the last bits of float64: `same`)

Inputs are drawn from fixed seeds and rounded to 4 decimals (so the file holds them exactly); the
expected float64 outputs and gradients are the built-in components' on those inputs, written to 12
significant digits. They are checked independently in tests/algorithms/test_fixtures.py: cispo and
sapo against the transcriptions of verl and TRL (`anchor_reference`), the estimators against the
loop oracle (`oracle`), the rest against formulas written out there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from rlhf.algorithms.conformance import FIXTURE_KINDS, FIXTURES_DIR, RUNNERS, TOLERANCE
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.core.plugin_host.settings import build_component_config

FORMAT = 1
B, A = 4, 5
CORRECTION_LOSSES = {  # the loss each correction case runs on, with that loss's settings
    "ppo": {"clip_low": 0.2, "clip_high": 0.2},
    "gspo": {"clip_low": 0.2, "clip_high": 0.2},
    "cispo": {"clip_low": 1.0, "clip_high": 0.2},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
}


def rounded(x: torch.Tensor) -> list:
    return torch.round(x.to(torch.float64), decimals=4).tolist()


def draw(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return lambda *shape, scale=1.0: torch.randn(*shape, generator=generator, dtype=torch.float64) * scale


def gapped_mask(rows: int, width: int, lengths: list[int], gaps: list[tuple[int, int]]) -> torch.Tensor:
    """1 on the first ``lengths[i]`` positions of row i, 0 at the (row, position) ``gaps`` (a multi-turn
    mask: environment tokens inside the response)."""
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float64)
    for row, position in gaps:
        mask[row, position] = 0.0
    return mask


# --- policy losses ------------------------------------------------------------------------------


def policy_inputs(seed: int, *, extreme: bool = False, rollout_shift: float = 0.0) -> dict[str, Any]:
    normal = draw(seed)
    old = -normal(B, A).abs() * 1.5 - 0.05  # (B, A) log-probs < 0
    log_ratio = normal(B, A, scale=0.3)
    if extreme:  # some tokens far off-policy: beyond ppo's clip and beyond the ±20 log-ratio clamp
        log_ratio[0, 1], log_ratio[1, 0], log_ratio[2, 2], log_ratio[3, 0] = 3.0, -4.0, 25.0, -22.0
    advantages = normal(B, A)
    advantages[1, 3] = 0.0
    rollout = old + normal(B, A, scale=0.6)
    rollout[0] += rollout_shift  # row 0's geometric-mean weight leaves [0.5, 5]: seq_mask_tis drops it
    return {"logprobs": rounded(old + log_ratio), "old_logprobs": rounded(old), "advantages": rounded(advantages),
            "loss_mask": rounded(gapped_mask(B, A, [5, 3, 5, 2], [(0, 2), (2, 1)])),
            "rollout_logprobs": rounded(rollout), "grad_output": rounded(normal(B, A))}


def policy_sets() -> dict[str, Any]:
    case = lambda name, seed, settings, optional=None, **kw: {  # noqa: E731
        "name": name, "settings": settings, **({"optional_settings": optional} if optional else {}),
        "inputs": policy_inputs(seed, **kw)}
    sets = {
        "ppo": [case("symmetric clip", 1, {"clip_low": 0.2, "clip_high": 0.2}),
                case("clip-higher, far off-policy tokens", 2, {"clip_low": 0.2, "clip_high": 0.28}, extreme=True),
                case("dual clip", 3, {"clip_low": 0.2, "clip_high": 0.2}, {"dual_clip": 3.0}, extreme=True)],
        "gspo": [case("symmetric clip", 4, {"clip_low": 0.2, "clip_high": 0.2}),
                 case("narrow clip with dual clip", 5, {"clip_low": 0.05, "clip_high": 0.05}, {"dual_clip": 2.0})],
        "cispo": [case("no lower bound", 6, {"clip_low": 1.0, "clip_high": 0.2}, extreme=True),
                  case("two-sided bounds", 7, {"clip_low": 0.2, "clip_high": 0.28}, extreme=True)],
        "sapo": [case("the paper's temperatures", 8, {"tau_pos": 1.0, "tau_neg": 1.05}),
                 case("sharp gates, far off-policy tokens", 9, {"tau_pos": 2.0, "tau_neg": 4.0}, extreme=True)],
    }
    for offset, correction in enumerate(("tis", "icepop", "seq_mask_tis")):
        sets[correction] = [
            {**case(f"{correction} on {loss}", 20 + 4 * offset + i,
                    {**settings, "correction": correction, "correction_bounds": [0.5, 5.0]}, rollout_shift=1.0),
             "loss": loss}
            for i, (loss, settings) in enumerate(CORRECTION_LOSSES.items())]
    return sets


# --- KL estimators and aggregations -------------------------------------------------------------------


def kl_sets() -> dict[str, Any]:
    def case(name, seed, scale):
        normal = draw(seed)
        ref = -normal(B, A).abs() * 2 - 0.05
        return {"name": name, "settings": {},
                "inputs": {"logprobs": rounded(ref + normal(B, A, scale=scale)), "ref_logprobs": rounded(ref),
                           "grad_output": rounded(normal(B, A))}}
    return {name: [case("near the reference", 30 + i, 0.3), case("far from the reference", 40 + i, 3.0)]
            for i, name in enumerate(("k1", "k2", "k3"))}


def aggregation_sets() -> dict[str, Any]:
    def case(name, seed, extra_tokens, extra_sequences):
        normal = draw(seed)
        mask = gapped_mask(B, A, [5, 0, 3, 4], [(0, 1)])  # row 1 has no loss token
        return {"name": name, "settings": {},
                "inputs": {"loss": rounded(normal(B, A)), "loss_mask": rounded(mask),
                           "num_tokens": float(mask.sum()) + extra_tokens,
                           "num_sequences": float((mask.sum(-1) > 0).sum()) + extra_sequences, "max_new_tokens": 8}}
    return {name: [case("the whole step", 50 + i, 0, 0), case("one micro-batch of a larger step", 60 + i, 7, 2)]
            for i, name in enumerate(("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                      "seq_mean_token_sum_norm"))}


# --- advantage estimators -------------------------------------------------------------------------


GROUPS, N = 2, 3


def estimator_inputs(seed: int, *, critic: bool, kl_coef: float = 0.0, left_out: int | None = None,
                     equal_group: bool = False) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    rows = GROUPS * N
    rewards = torch.rand(rows, generator=generator, dtype=torch.float64)
    if equal_group:
        rewards[:N] = 0.5  # one group without variance: GRPO's std is 0
    mask = gapped_mask(rows, A, [5, 3, 1, 4, 5, 2], [(0, 2), (4, 3)])
    inputs = {"rewards": rounded(rewards), "action_mask": rounded(mask), "group_size": N, "kl_coef": kl_coef,
              "kl": rounded(torch.rand(rows, A, generator=generator, dtype=torch.float64) * 0.2 * mask)}
    if critic:
        inputs["values"] = rounded(torch.randn(rows, A, generator=generator, dtype=torch.float64) * 0.5 * mask)
    if left_out is not None:
        inputs["sample_mask"] = [i != left_out for i in range(rows)]
    return inputs


def estimator_sets() -> dict[str, Any]:
    sets = {}
    base = {"gamma": 1.0, "lambd": 1.0, "std_norm": True, "reward_clip": 10.0}
    for i, name in enumerate(("gae", "reinforce_pp", "reinforce_pp_baseline", "rloo", "grpo", "dr_grpo")):
        critic = name == "gae"
        seed = 70 + 10 * i
        cases = [{"name": "defaults", "settings": base, "inputs": estimator_inputs(seed, critic=critic)},
                 {"name": "kl in the reward, a sample left out", "settings": base,
                  "inputs": estimator_inputs(seed + 1, critic=critic, kl_coef=0.05, left_out=4)}]
        if name in ("gae", "reinforce_pp"):
            cases.append({"name": "discounted, not divided by the std",
                          "settings": {**base, "gamma": 0.9, "lambd": 0.95, "std_norm": False},
                          "inputs": estimator_inputs(seed + 2, critic=critic, kl_coef=0.05)})
        else:
            cases.append({"name": "a group with equal rewards", "settings": base,
                          "inputs": estimator_inputs(seed + 2, critic=critic, equal_group=True)})
        sets[name] = cases
    return sets


# --- expected outputs -----------------------------------------------------------------------------


DESCRIPTIONS = {
    "advantage_estimator": "obj(AdvantageInputs(rewards, action_mask, kl, kl_coef, values, group_size, sample_mask), "
                           "config) -> advantages, returns (B, A)",
    "policy_loss": "obj(PolicyLossInputs(logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs), config) "
                   "-> loss (B, A); grad_logprobs = d sum(loss * grad_output) / d logprobs",
    "kl_estimator": "obj(logprobs, ref_logprobs) -> kl (B, A); grad_logprobs = d sum(kl * grad_output) / d logprobs",
    "loss_aggregation": "obj(loss, loss_mask, LossNorm(num_tokens, num_sequences, max_new_tokens)) -> value (); "
                        "grad_loss = d value / d loss",
}
MAKERS = {"advantage_estimator": estimator_sets, "policy_loss": policy_sets, "kl_estimator": kl_sets,
          "loss_aggregation": aggregation_sets}


def significant(value: Any) -> Any:
    """Floats as float64 (JSON holds their shortest exact form); -0.0 as 0.0."""
    if isinstance(value, list):
        return [significant(v) for v in value]
    return float(value) + 0.0


def fixtures(kind: str) -> dict[str, Any]:
    """The fixture file of ``kind``: its cases with the built-in components' outputs."""
    registry = build_plugin_manager(load_entrypoints=False).registries()[kind]
    sets = {}
    for name, cases in MAKERS[kind]().items():
        for case in cases:
            component = registry.component(case.get("loss") or name)
            config_cls = component.load_config_cls()
            settings = {**case["settings"], **case.get("optional_settings", {})}
            config = build_component_config(config_cls, settings=settings, run_values={}, who=name, flag="")
            outputs = RUNNERS[kind](component.load(), config, case["inputs"])
            case["expected"] = {key: significant(value.detach().to(torch.float64).tolist())
                                for key, value in outputs.items()}
            if kind == "policy_loss" and case.get("loss"):
                case["reference"] = {"correction_weights": correction_weights(case)}
        sets[name] = {"cases": cases}
    return {"format": FORMAT, "kind": kind, "call": DESCRIPTIONS[kind], "tolerance": TOLERANCE,
            "tolerance_rule": "|got - expected| <= tolerance * max(1, |expected|)", "sets": sets}


def correction_weights(case: dict[str, Any]) -> list:
    """The correction's weights on this case (for other frameworks; not compared by the check)."""
    from rlhf.plugins.algorithms.policy_losses import correction_weights as weights_of

    inputs = case["inputs"]
    weights, _ = weights_of(torch.tensor(inputs["old_logprobs"], dtype=torch.float64),
                            torch.tensor(inputs["rollout_logprobs"], dtype=torch.float64),
                            kind=case["settings"]["correction"], bounds=tuple(case["settings"]["correction_bounds"]),
                            loss_mask=torch.tensor(inputs["loss_mask"], dtype=torch.float64))
    return significant(weights.tolist())


def dump(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":")) + "\n"


def same(fresh: Any, shipped: Any) -> bool:
    """The same structure, strings and integers, and floats within 8 float64 ulps of max(1, |x|):
    torch's vectorised exp and log differ by an ulp between AVX-512 and AVX2 CPUs."""
    if isinstance(fresh, dict):
        return isinstance(shipped, dict) and fresh.keys() == shipped.keys() and all(
            same(fresh[key], shipped[key]) for key in fresh)
    if isinstance(fresh, list):
        return isinstance(shipped, list) and len(fresh) == len(shipped) and all(map(same, fresh, shipped))
    if isinstance(fresh, float) and isinstance(shipped, (float, int)) and not isinstance(shipped, bool):
        return fresh == shipped or abs(fresh - shipped) <= 8 * sys.float_info.epsilon * max(1.0, abs(shipped))
    return type(fresh) is type(shipped) and fresh == shipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for kind in FIXTURE_KINDS:
        path = Path(FIXTURES_DIR) / f"{kind}.json"
        text = dump(fixtures(kind))
        if args.check:
            if not path.exists() or not same(json.loads(text), json.loads(path.read_text())):
                stale.append(str(path))
        else:
            path.write_text(text)
            print(f"wrote {path} ({len(text) // 1024} KiB)")
    if stale:
        print(f"stale: {', '.join(stale)}; run python -m tests.algorithms.make_fixtures", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
