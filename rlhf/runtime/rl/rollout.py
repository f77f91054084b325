"""Rollouts: prompts -> trajectories, over one or many turns with an environment (docs/environments.md).

Every trajectory gets its own environment. Single-turn rollouts, and multi-turn ones on an engine
without continuous batching, go turn by turn, each turn batched across every trajectory still
running: the engine generates (stopping at EOS, the budget, or the environment's stop strings),
each environment steps on its turn's text, and the observation is appended with loss mask 0.
An episode ends when the environment says done, the model emits EOS, ``max_turns`` is reached,
or the trajectory's token budget (prompt + every turn + observations) is spent. Only model
tokens carry loss mask 1, so environment text never enters the policy loss. Observations are
tokenised as plain text (`plain_token_ids`): tool output that prints ``<|im_end|>`` gets the
characters, never the control token, so it cannot forge a turn boundary in the model's context.

Every trajectory ends with an outcome (`rlhf.core.outcomes`): ``ok``, ``truncated`` when a limit
ended it, ``env_error`` when its environment's ``reset`` or ``step`` raised, ``tool_timeout`` when
one of those calls ran past ``env_timeout_s`` (``--env-timeout-s``; a blocking call's worker thread
is abandoned, an inline one, ``blocking = False``, cannot be interrupted). A failed episode stops
there; the others go on. An environment that breaks its contract (`EnvContractError`) or cannot
be set up (`ConfigError`) is a bug, not a failure: it stops the run.

With an engine that batches continuously (registered with ``continuous_batching``,
`rlhf.core.protocols.rollout.batches_continuously`: the ``hf`` engine's default) a multi-turn
rollout runs every trajectory on its own instead: reset, then turn after turn, each turn a
request of its own that joins the engine's running decode batch,
so a trajectory whose tool call returns early generates its next turn while slower ones still
wait. Each request samples from a random stream of its own, seeded from one draw of the
process's stream per rollout, the trajectory's index and the turn: what a trajectory samples
does not depend on when the others' tool calls return (up to the float rounding of a forward
over a different batch). The rollout then says so (`rlhf.runtime.rl.draw_order`): with ``--async``
another batch's rollout may start beside it.

With ``--agent`` no environment is made: each trajectory is one call of the user's agent, which talks
to the engine through an OpenAI-compatible endpoint of its own (`rlhf.runtime.agents`, docs/agents.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.core.protocols.environment import AsyncEnv, EnvContractError, EnvDeclarations, create_env, route_env
from rlhf.core.errors import ConfigError, RlhfError
from rlhf.core.outcomes import ENV_ERROR, TOOL_TIMEOUT, error_line, outcome_of_finish
from rlhf.core.plugin_host.references import resolve
from rlhf.core.plugin_host.registry import declared_registration
from rlhf.core.plugin_host.settings import build_component_config
from rlhf.core.protocols.rollout import Generation, SamplingParams, batches_continuously
from rlhf.core.types import Trajectory
from rlhf.runtime.rl.draw_order import random_draws_done

log = logging.getLogger(__name__)


MAX_ENV_THREADS = 256  # blocking environment calls in flight at once, per rollout batch


@dataclass(kw_only=True)
class RolloutSettings:
    env: str = "single_turn"  # default environment (registered name or module:Class)
    max_turns: int = 1
    max_total_tokens: int = 2048  # prompt + all turns + observations, per trajectory
    env_timeout_s: float | None = None  # seconds one reset or step may take (None: no limit); then tool_timeout


class EnvFactory:
    """Resolves environment names once (registered names and ``module:Class``) and builds instances.

    ``settings_for(name, config_cls)`` gives the user's settings for an environment's config class;
    ``run_values`` are the run's values for its run fields (``rlhf.core.plugin_host.settings``).
    """

    def __init__(self, registry: Any, settings_for: Callable[[str, type | None], dict[str, Any]],
                 run_values: dict[str, Any]):
        self.registry, self.settings_for, self.run_values = registry, settings_for, run_values
        self._resolved: dict[str, tuple[type, Any, dict[str, Any]]] = {}

    def capabilities(self, name: str) -> dict[str, Any]:
        """The environment's capability flags (``multi_turn``, ``gives_rewards``): a registered env's
        registration flags, or a ``module:Class``'s own class attributes, else the kind's defaults."""
        return self._resolve(name)[2]

    def __call__(self, name: str) -> AsyncEnv:
        env_cls, config, _ = self._resolve(name)
        return AsyncEnv(create_env(env_cls, config), name=name, declarations=EnvDeclarations.of(env_cls))

    def _resolve(self, name: str) -> tuple[type, Any, dict[str, Any]]:
        if name not in self._resolved:
            found = resolve(name, self.registry)
            if found.registered:
                component = self.registry.component(name)
                config_cls, capabilities = component.load_config_cls(), dict(component.capabilities)
            else:
                config_cls, capabilities = declared_registration(self.registry.kind, found.obj, name)
            config = build_component_config(config_cls, settings=self.settings_for(name, config_cls),
                                            run_values=self.run_values, who=f"the {name!r} env", flag="--env")
            EnvDeclarations.of(found.obj)  # its optional members read (and checked) once, with the rest
            self._resolved[name] = (found.obj, config, capabilities)
        return self._resolved[name]


@dataclass(eq=False)
class _Episode:
    """A trajectory being built."""

    item: Any  # the PromptItem
    group: int
    env: AsyncEnv
    label: Any
    tokens: list[int]
    mask: list[int]
    logprobs: list[float] | None
    stop: tuple[str, ...] = ()
    done: bool = False
    finish_reason: str = "stop"
    turns: int = 0
    env_reward: float = 0.0
    env_time: float = 0.0
    step_infos: list[dict] = field(default_factory=list)
    failure: tuple[str, str] | None = None  # (outcome, error line) when an environment call failed
    versions: list[int] | None = None  # --partial-rollouts: per token, the version that sampled it (-1: not the policy)

    pending_versions: list[int] = field(default_factory=list)  # the versions of the turn being recorded
    # log-probs asked for only where free (tokens.jsonl): a turn the engine reports none for leaves
    # the episode with none, never zeros standing in for them
    logprobs_optional: bool = False

    def append(self, ids: list[int], *, model: bool, logprobs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        self.tokens += ids
        self.mask += [1 if model else 0] * len(ids)
        if self.versions is not None:
            self.versions += versions if model and versions is not None else [-1] * len(ids)
        if self.logprobs is not None and model and logprobs is None and self.logprobs_optional:
            self.logprobs = None
        if self.logprobs is not None:
            self.logprobs += logprobs if model and logprobs is not None else [0.0] * len(ids)


def plain_token_ids(tokenizer: Any, text: str, control: set[int] | None = None) -> list[int]:
    """``text`` (an environment's observation: tool output, sandboxed code's prints) as token ids
    with every character taken as text: a special token's string in it (``<|im_end|>``,
    ``<|im_start|>assistant``) is split into ordinary tokens (``split_special_tokens``), never
    parsed into the control token. A tokenizer that ignores the setting and still yields one is
    an error rather than a forged turn boundary. ``control``: `control_token_ids`, if known."""
    ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    forged = (control_token_ids(tokenizer) if control is None else control).intersection(ids)
    if forged:
        raise RlhfError(f"the tokenizer ({type(tokenizer).__name__}) encoded observation text into the control "
                        f"token(s) {sorted(forged)} although asked not to (split_special_tokens=True); use a "
                        "tokenizer that supports it (any Hugging Face tokenizer does)")
    return ids


def control_token_ids(tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's special tokens (BOS/EOS/pad..., and added ones marked special,
    such as chat turn markers), but unknown-token: plain text may encode to that."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    ids |= {i for i, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
            if getattr(token, "special", False)}
    ids.discard(getattr(tokenizer, "unk_token_id", None))
    return ids


class RolloutWorker:
    """Turns prompts into trajectories with a rollout engine and environments (`RolloutRole`)."""

    stateful = False  # its random numbers are this process's, which every checkpoint saves

    def __init__(self, engine: Any, tokenizer: Any, env_factory: Any, settings: RolloutSettings, *,
                 set_aside: Sequence[Any] = (), continuous_batching: bool = False, agents: Any = None):
        """``set_aside``: training backends (``offloads_state``) whose training state leaves the device
        while this worker generates (``--offload-train-state``); their parameters too when the engine
        has weights of its own. ``continuous_batching``: the engine's registration declares it
        (`rlhf.core.protocols.rollout.ContinuousEngine`). ``agents``: with ``--agent``, the
        `rlhf.runtime.agents.rollout.AgentRollout` that makes every trajectory instead of environments."""
        self.engine, self.tokenizer = engine, tokenizer
        self.continuous_batching = continuous_batching
        self.make_env, self.settings = env_factory, settings
        self.set_aside = list(set_aside)
        self.told_offload = False  # the first set-aside's size is logged once
        self._control_ids: set[int] | None = None  # the tokenizer's special tokens, never taken from observations
        self.agents = agents
        # --partial-rollouts: the batch's versions (`rlhf.runtime.rl.offpolicy.partial.PartialRollout`), set
        # by the producer for each batch it rolls out; None: every token from this worker's engine
        self.partial: Any = None

    def generate(self, prompts: list[Any], *, n: int, params: SamplingParams) -> list[Trajectory]:
        """``n`` trajectories per prompt, contiguous, in prompt order."""
        with self._training_state_set_aside():
            return self._generate(prompts, n, params)

    def for_versions(self, partial: Any) -> RolloutWorker:
        """This worker for one batch of ``--partial-rollouts``: its turns sampled by the engines of the
        versions ``partial`` gives (`rlhf.runtime.rl.offpolicy.partial.PartialRollout`); this one as it is."""
        view = copy.copy(self)
        view.partial = partial
        return view

    @contextlib.contextmanager
    def _training_state_set_aside(self) -> Iterator[None]:
        moved, total = [], 0
        try:
            for backend in self.set_aside:
                total += backend.offload_state(not self.engine.shares_weights)
                moved.append(backend)
            if total and not self.told_offload:
                log.info("--offload-train-state: %d bytes of training state off the device while generating", total)
                self.told_offload = True
            yield
        finally:
            for backend in moved:
                backend.reload_state()

    def _generate(self, prompts: list[Any], n: int, params: SamplingParams) -> list[Trajectory]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self._rollout(prompts, n, params))
        # called from inside an event loop (a notebook): run ours in a thread
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self._rollout(prompts, n, params)).result()

    def sync_weights(self) -> None:
        """Engines that sample from the policy module in place need nothing; others take its weights."""
        if not self.engine.shares_weights:
            self.engine.load_weights()

    def save(self, directory: Path) -> None:
        """Nothing of its own to save (not ``stateful``)."""

    def load(self, directory: Path) -> None:
        """Nothing of its own to load (not ``stateful``)."""

    # --- the episode loop ---------------------------------------------------------------------

    async def _rollout(self, prompts: list[Any], n: int, params: SamplingParams) -> list[Trajectory]:
        if self.agents is not None:
            return await self._agent_rollout(prompts, n, params)
        episodes = [self._start(item, group, params) for group, item in enumerate(prompts) for _ in range(n)]
        # A blocking environment call runs on the loop's default executor, whose few threads (cores + 4)
        # would queue a batch's slow tool calls: a thread per trajectory, up to a cap, instead.
        asyncio.get_running_loop().set_default_executor(_EnvThreads(
            max_workers=max(1, min(len(episodes), MAX_ENV_THREADS)), thread_name_prefix="rlhf-env"))
        try:
            if (self._multi_turn(episodes) or self.partial is not None) and batches_continuously(
                    self.engine, params, declared=self.continuous_batching):
                await self._each_on_its_own(episodes, params)
                return [self._trajectory(e) for e in episodes]
            if self.partial is not None:
                raise RlhfError("--partial-rollouts: the engine declined continuous batching for these sampling "
                                "options (its continuous_for): drop --partial-rollouts")
            await self._timed(episodes, [e.env.reset(e.item.prompt, e.label, e.item.columns) for e in episodes],
                              self._after_reset)
            for turn in range(self.settings.max_turns):
                active = [e for e in episodes if not e.done]
                if not active:
                    break
                generations = self._generate_turn(active, params)
                for episode, generation in zip(active, generations):
                    self._record_turn(episode, generation, last_turn=turn == self.settings.max_turns - 1)
                await self._timed(active, [e.env.step(self._action_text(g)) for e, g in zip(active, generations)],
                                  self._after_step)
        finally:
            await asyncio.gather(*(e.env.close() for e in episodes), return_exceptions=True)
        return [self._trajectory(e) for e in episodes]

    async def _agent_rollout(self, prompts: list[Any], n: int, params: SamplingParams) -> list[Trajectory]:
        """``--agent``: one agent call per trajectory, its requests served by the agent endpoint with
        this rollout's seed (`rlhf.runtime.agents.rollout`)."""
        import torch

        rollout_seed = int(torch.randint(0, 2 ** 62, (1,)).item())  # the one draw of the process's stream
        random_draws_done()
        return await self.agents.run(prompts, n, rollout_seed, logprobs=params.return_logprobs,
                                     policy_version=params.policy_version)

    def close(self) -> None:
        """Stop the agent endpoint, if this worker started one."""
        if self.agents is not None:
            self.agents.endpoint.stop()

    def _multi_turn(self, episodes: list[_Episode]) -> bool:
        """Whether some episode may take several turns (a single-turn environment's never does)."""
        return self.settings.max_turns > 1 and any(
            self.make_env.capabilities(name)["multi_turn"] for name in {e.env.name for e in episodes})

    async def _each_on_its_own(self, episodes: list[_Episode], params: SamplingParams) -> None:
        """Every trajectory's episode as a task of its own, its turns sent to the engine's continuous
        batch; the first failure cancels the others."""
        import torch

        rollout_seed = int(torch.randint(0, 2 ** 62, (1,)).item())  # the one draw of the process's stream
        random_draws_done()  # another batch's rollout may draw now (--async generation lanes)
        tasks = [asyncio.ensure_future(self._episode(e, params, rollout_seed, index)) for index, e in enumerate(episodes)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _episode(self, episode: _Episode, params: SamplingParams, rollout_seed: int, index: int) -> None:
        await self._timed([episode], [episode.env.reset(episode.item.prompt, episode.label, episode.item.columns)],
                          self._after_reset)
        for turn in range(self.settings.max_turns):
            if episode.done:
                return
            turn_params = dataclasses.replace(params, max_new_tokens=self._turn_budget(episode, params),
                                              stop=episode.stop, seed=request_seed(rollout_seed, index, turn))
            if self.partial is not None:
                generation = await self._partial_turn(episode, turn_params)
            else:
                generation = await self.engine.generate_one(list(episode.tokens), turn_params)
            self._record_turn(episode, generation, last_turn=turn == self.settings.max_turns - 1)
            await self._timed([episode], [episode.env.step(self._action_text(generation))], self._after_step)

    async def _partial_turn(self, episode: _Episode, params: SamplingParams) -> Generation:
        """One turn over the policy versions its tokens are due from (`rlhf.runtime.rl.offpolicy.partial`):
        a request per version, each re-reading the trajectory so far; the turn's versions go to
        ``episode.pending_versions`` for `_record_turn`."""
        from rlhf.runtime.rl.offpolicy.partial import chunk_seed

        partial, budget = self.partial, params.max_new_tokens
        start = sum(episode.mask)  # the trajectory's policy tokens so far: the clock
        tokens: list[int] = []
        logprobs: list[float] | None = [] if params.return_logprobs else None
        versions: list[int] = []
        while True:
            n = start + len(tokens)
            version, switch = partial.version(n), partial.next_switch(n)
            take = budget - len(tokens) if switch is None else min(budget - len(tokens), switch - n)
            engine = await partial.engine(version)
            seed = params.seed if not tokens else chunk_seed(params.seed, n)
            part = await engine.generate_one(list(episode.tokens) + tokens,
                                             dataclasses.replace(params, max_new_tokens=take, seed=seed))
            tokens += part.token_ids
            versions += [version] * len(part.token_ids)
            if logprobs is not None:
                logprobs += part.logprobs or [0.0] * len(part.token_ids)
            if part.finish_reason != "length" or len(part.token_ids) < take or len(tokens) >= budget:
                episode.pending_versions = versions
                return Generation(token_ids=tokens, finish_reason=part.finish_reason, logprobs=logprobs,
                                  stop_string=part.stop_string, extra=part.extra)

    def _start(self, item: Any, group: int, params: SamplingParams) -> _Episode:
        name, label = route_env(item.label, self.settings.env)
        try:
            env = self.make_env(name)
        except RlhfError as exc:
            raise RlhfError(f"{item.origin}: environment {name!r}: {exc}") from exc
        except Exception as exc:
            raise RlhfError(f"{item.origin}: could not create environment {name!r}: {type(exc).__name__}: {exc}") from exc
        prompt_ids = list(item.prompt_ids)
        episode = _Episode(item=item, group=group, env=env, label=label, tokens=prompt_ids, mask=[0] * len(prompt_ids),
                           logprobs=[0.0] * len(prompt_ids) if params.return_logprobs or params.logprobs_if_free
                           else None, logprobs_optional=not params.return_logprobs,
                           versions=[-1] * len(prompt_ids) if self.partial is not None else None)
        episode.stop = tuple(env.stop or ())
        return episode

    async def _timed(self, episodes: list[_Episode], calls: list[Any], then: Any) -> None:
        """Await one environment call per episode concurrently, charging each its own time."""

        limit = self.settings.env_timeout_s

        async def timed(episode: _Episode, call: Any) -> Any:
            started = time.perf_counter()
            try:
                return await (asyncio.wait_for(call, limit) if limit is not None else call)
            except (EnvContractError, ConfigError):
                raise
            except asyncio.TimeoutError as exc:  # past --env-timeout-s, or the environment's own time limit
                _EnvThreads.abandon()
                why = error_line(exc) if str(exc) or limit is None else f"took longer than --env-timeout-s {limit:g}"
                episode.failure = (TOOL_TIMEOUT, f"environment {episode.env.name!r} timed out on "
                                                 f"{episode.item.origin}: {why}")
            except Exception as exc:
                episode.failure = (ENV_ERROR, f"environment {episode.env.name!r} failed on {episode.item.origin}: "
                                              f"{error_line(exc)}")
            finally:
                episode.env_time += time.perf_counter() - started
            episode.done = True  # a failed episode ends here
            return None

        results = await asyncio.gather(*(timed(e, c) for e, c in zip(episodes, calls)))
        for episode, result in zip(episodes, results):
            if episode.failure is None:
                then(episode, result)

    def _after_reset(self, episode: _Episode, observation: str | None) -> None:
        if observation:
            self._observe(episode, observation)

    def _generate_turn(self, active: list[_Episode], params: SamplingParams) -> list[Generation]:
        """One batched generate per distinct stop-string set; each turn capped by its own budget."""
        out: dict[int, Generation] = {}
        by_stop: dict[tuple[str, ...], list[_Episode]] = {}
        for episode in active:
            by_stop.setdefault(episode.stop, []).append(episode)
        for stop, group in by_stop.items():
            budgets = [self._turn_budget(e, params) for e in group]
            turn_params = dataclasses.replace(params, max_new_tokens=max(budgets), stop=stop)
            generations = self.engine.generate([e.tokens for e in group], n=1, params=turn_params)
            for episode, generation, budget in zip(group, generations, budgets):
                if len(generation.token_ids) > budget:  # a shorter budget than the group's longest
                    generation = Generation(token_ids=generation.token_ids[:budget], finish_reason="budget",
                                            logprobs=generation.logprobs[:budget] if generation.logprobs else None)
                out[id(episode)] = generation
        return [out[id(e)] for e in active]

    def _turn_budget(self, episode: _Episode, params: SamplingParams) -> int:
        return max(1, min(params.max_new_tokens, self.settings.max_total_tokens - len(episode.tokens)))

    def _record_turn(self, episode: _Episode, generation: Generation, *, last_turn: bool) -> None:
        episode.append(generation.token_ids, model=True, logprobs=generation.logprobs,
                       versions=episode.pending_versions)
        episode.turns += 1
        episode.finish_reason = generation.finish_reason
        ended_by_eos = generation.finish_reason == "stop" and generation.stop_string is None
        if ended_by_eos or len(episode.tokens) >= self.settings.max_total_tokens:
            episode.done = True
            if not ended_by_eos:
                episode.finish_reason = "budget"
        elif last_turn:
            episode.done, episode.finish_reason = True, "max_turns" if generation.finish_reason == "stop" else "length"

    def _action_text(self, generation: Generation) -> str:
        return self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)

    def _after_step(self, episode: _Episode, result: Any) -> None:
        episode.env_reward += float(result.reward)
        if result.info:
            episode.step_infos.append(dict(result.info))
        if result.done:
            episode.done = True
            if episode.finish_reason not in ("length", "budget"):
                episode.finish_reason = "stop"
            return
        if episode.done:  # EOS, budget or the last turn: the env's observation has nowhere to go
            return
        episode.stop = tuple(result.stop or ())
        if result.observation:
            self._observe(episode, result.observation)

    def _observe(self, episode: _Episode, text: str) -> None:
        if self._control_ids is None:
            self._control_ids = control_token_ids(self.tokenizer)
        ids = plain_token_ids(self.tokenizer, text, self._control_ids)
        room = self.settings.max_total_tokens - len(episode.tokens)
        if len(ids) >= room:  # no budget left for another model turn after this observation
            ids, episode.done, episode.finish_reason = ids[:max(room, 0)], True, "budget"
        episode.append(ids, model=False)

    def _trajectory(self, episode: _Episode) -> Trajectory:
        item = episode.item
        prompt_len = len(item.prompt_ids)
        return Trajectory(
            token_ids=episode.tokens, loss_mask=episode.mask, prompt_length=prompt_len, prompt=item.prompt,
            prompt_text=item.prompt_text,
            completion_text=self.tokenizer.decode(episode.tokens[prompt_len:], skip_special_tokens=True),
            group=episode.group, label=item.label, columns=dict(item.columns), rollout_logprobs=episode.logprobs,
            token_versions=episode.versions,
            finish_reason=episode.finish_reason, num_turns=episode.turns,
            outcome=episode.failure[0] if episode.failure else outcome_of_finish(episode.finish_reason),
            error=episode.failure[1] if episode.failure else None,
            info={"env": episode.env.name, "multi_turn": self.make_env.capabilities(episode.env.name)["multi_turn"],
                  "env_gives_rewards": bool(self.make_env.capabilities(episode.env.name)["gives_rewards"]),
                  "env_reward": episode.env_reward, "env_time_s": episode.env_time,
                  **({"env_steps": episode.step_infos} if episode.step_infos else {})},
        )


class _EnvThreads(concurrent.futures.ThreadPoolExecutor):
    """A rollout's threads for blocking environment calls. When a call ran past ``--env-timeout-s``,
    the rollout ends without waiting for its thread (which finishes, or not, on its own)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=wait and not getattr(self, "abandoned", False), cancel_futures=cancel_futures)

    @staticmethod
    def abandon() -> None:
        """A call of the running loop's rollout was abandoned: its executor will not wait for it."""
        executor = getattr(asyncio.get_running_loop(), "_default_executor", None)
        if isinstance(executor, _EnvThreads):
            executor.abandoned = True


def request_seed(rollout_seed: int, trajectory: int, turn: int) -> int:
    """The seed of one turn's request: a hash of the rollout's seed, the trajectory's index and the turn."""
    digest = hashlib.blake2b(f"{rollout_seed}/{trajectory}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits
