"""Every hook a plugin can implement. Each docstring is the contract.

A plugin is a module (or any object) with functions decorated by ``@rlhf.hookimpl`` (the same
marker as ``rlhf.api.hookimpl``) whose names match the specs below, and imports what else it
needs of rlhf from ``rlhf.api`` (docs/plugins.md lists it). Two families:

* Registration hooks, ``register_<kind>s(register)``: called once per plugin when a run (or
  ``rlhf plugins list``) needs that kind. ``register(name, obj, *, description=None,
  config_cls=None, **capabilities)`` adds one component; call it as often as you like.
  ``obj`` may also be a ``"module.path:attr"`` string, imported only when a run asks for the
  name (keeps ``rlhf --help`` fast when the component needs torch). ``description`` defaults to
  the first line of ``obj``'s docstring; ``config_cls`` is a ``@dataclass(kw_only=True)`` whose
  fields carry ``metadata={"help": ...}`` and which ``rlhf plugins show NAME`` prints.
  Names are case-insensitive and ``-`` equals ``_``. ``aliases=("other", ...)`` gives the
  component more names that look it up (it keeps its own in logs). A name or alias provided by
  two plugins is an error that names both packages: nothing is ever silently overridden.
* A config class's fields are the user's **settings**: each gets a command-line flag named after
  the slot that selects the component, ``--<slot>.<field>`` (``--policy-loss.clip-high``,
  ``--backend.zero-stage``, ``--env.timeout-s``), a key under ``components`` in a ``--config``
  file, and ``--algo-config`` / ``--engine-config`` / ``--env-config KEY=VALUE``. A field that
  needs a value of the run declares it, ``rlhf.api.run_field("seed", default, help)``
  (the run values: ``rlhf.core.plugin_host.settings.RUN_VALUES``); nothing else of the run reaches a config,
  whatever its fields are called.
* ``register(..., short_flags=("zero_stage", ...))`` gives those settings a plain flag too
  (``--zero-stage`` besides ``--backend.zero-stage``), on the command line, in config files and
  in ``TrainConfig.from_dict``: the built-ins declare theirs this way and have no other. A short
  flag that is already an option of the command stays namespaced only; one another slot's
  component declared first too, with a warning in ``rlhf plugins list``.
* Engines, backends and model adapters are classes implementing a written protocol
  (``rlhf.core.protocols.rollout.RolloutEngine``, ``rlhf.core.protocols.backend.TrainBackend``,
  ``rlhf.core.protocols.adapter.ModelAdapter``), checked when registered (when first used, for a
  ``"module:attr"`` reference); a class missing a member is refused with the list of what it lacks.
* What a component can do beyond its kind's contract is declared with the registration, as
  flags (``continuous_batching=True``, ``offloads_state=True``) or as the name of one of its
  settings (``sharding_setting="zero_stage"``, ``merge_setting=``, ``preference_strength=``);
  a flag that promises more methods is checked against their protocol, a setting name against
  the config class. The host reads only these: it never probes a component for what it might
  have, so a third-party component that declares the same gets the built-ins' treatment.
* Lifecycle hooks, ``on_*``: events the trainer fires during a run; every plugin that
  implements one is called (loggers are plugins on these hooks).

Grow a spec only by adding arguments: an implementation may declare any subset of a spec's
arguments, in any order. Pluggy's trap: an implementation argument with a default value is
never passed (it always keeps its default), so declare arguments without defaults.

Shape legend: ``B`` sequences in a batch (n samples of each prompt are contiguous rows),
``A`` action positions (``T - 1`` for ``T`` tokens: position t predicts token t+1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from pathlib import Path

    import click
    import torch

    from rlhf.core.types import RunInfo, Trajectory

PROJECT_NAME = "rlhf"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[..., None]


# --- registration hooks -------------------------------------------------------------------


@hookspec
def register_advantage_estimators(register: Register) -> None:
    """Register advantage estimators (``--advantage NAME``).

    - ``register(name, estimator, *, needs_critic=False, needs_groups=False, supports_masking=False,
      config_cls=None, implements=None)``; ``needs_critic``: the run must build a critic and pass values;
      ``needs_groups``: the estimator compares the n samples of a prompt, and the runtime refuses
      to start with n < 2; ``supports_masking``: it leaves samples whose ``sample_mask`` is False
      out of every statistic (its baselines taken over the others) and gives them advantage 0, so
      ``--on-failure mask`` may keep failed samples in their groups (refused otherwise);
      ``implements``: the method(s) whose reference fixtures ``rlhf plugins check`` runs it on
      (``"grpo"``, ``"gae"``, ...; docs/algorithms.md, "Conformance").
    - ``estimator(inputs, config) -> (advantages, returns)``, both ``(B, A)`` and zero where
      ``action_mask`` is 0; called once per rollout batch, under ``torch.no_grad()``
      (``rlhf.algorithms.compute_advantages`` calls it by name).
    - ``inputs`` (``rlhf.core.types.AdvantageInputs``): ``rewards (B,)`` float sequence rewards,
      ``action_mask (B, A)`` float 0/1, ``kl (B, A)`` per-token KL to place in the reward or
      ``None``, ``kl_coef`` (β), ``values (B, A)`` or ``None``, ``group_size`` (n; rows of one
      prompt are contiguous), ``sample_mask (B,)`` bool or ``None`` (False: leave the sample out
      of group statistics and whitening, give it advantage and return 0), ``source_rewards``
      (``{source name: (B,)}``, NaN where a source gave none) and ``metadata`` (one dict per row:
      dataset columns, ``label``, ``info``, ``finish_reason``, ...).
    - ``config``: an ``rlhf.core.types.AdvantageConfig`` (``gamma``, ``lambd``, ``std_norm``,
      ``reward_clip``), or an instance of ``config_cls``, which should subclass it.
    """


@hookspec
def register_policy_losses(register: Register) -> None:
    """Register per-token policy losses (``--policy-loss NAME``).

    - ``register(name, loss, *, config_cls=None, needs_rollout_logprobs=False, aggregation=None,
      advantage_weighted=False, implements=None)``.
    - ``implements``: the method(s) whose reference fixtures ``rlhf plugins check`` runs the loss
      on, a name or a tuple: ``"ppo"``, ``"gspo"``, ``"cispo"``, ``"sapo"``, and the mismatch
      corrections it offers, ``("cispo", "tis")`` (docs/algorithms.md, "Conformance").
    - ``needs_rollout_logprobs``: the loss reads ``inputs.rollout_logprobs`` (the engine is then
      asked for them); a bool, or a function of the loss's config object (``ppo`` needs them only
      with a mismatch ``correction``).
    - ``aggregation``: a loss aggregation this loss is always reduced with, whatever the run's
      ``--loss-agg`` (``gspo``: ``seq_mean_token_mean``); None: the run's.
    - ``advantage_weighted``: every token's loss is its advantage times a finite factor, so a row
      whose advantages are all 0 adds exactly 0 to the loss and its gradient; with an aggregation
      that ``sums_rows`` and no KL or entropy term, training then skips such rows' forwards
      (``ppo``, ``gspo``, ``cispo`` and ``sapo`` declare it).
    - ``loss(inputs, config) -> (per_token_loss, metrics)``: ``inputs`` an
      ``rlhf.core.types.PolicyLossInputs`` (``logprobs (B, A)`` with grad, ``old_logprobs``,
      ``advantages``, ``loss_mask`` float 0/1 (the action tokens of the samples that count), all
      ``(B, A)``, and ``rollout_logprobs (B, A)`` or ``None``: the rollout engine's log-probs);
      ``config`` an instance of ``config_cls`` or ``None``. The loss per token is ``(B, A)`` and 0
      where ``loss_mask`` is 0; the metrics are
      detached scalars under namespaced keys (``policy/clip_frac``, ``policy/approx_kl``, ...).
    - Called once per micro-batch by the run's training loss (rlhf/algorithms/training_loss.py;
      ``rlhf.algorithms.policy_objective`` computes the same from names): the host adds the KL and
      entropy terms and the aggregation.
    """


@hookspec
def register_kl_estimators(register: Register) -> None:
    """Register KL estimators (``--kl-estimator NAME``).

    ``register(name, estimator, *, implements=None)``; ``implements``: the method whose reference
    fixtures ``rlhf plugins check`` runs it on (``"k1"``, ``"k2"``, ``"k3"``).

    ``estimator(logprobs, ref_logprobs) -> kl``: all three ``(B, A)`` float. The host
    (``rlhf.algorithms.training_loss.clamped_kl``) clamps the result to [-10, 10] and masks it; the
    estimator sees raw log-probs. KL goes into the reward or into the loss, never both.
    """


@hookspec
def register_loss_aggregations(register: Register) -> None:
    """Register loss aggregations (``--loss-agg NAME``).

    ``register(name, aggregate, *, sums_rows=False, implements=None)``. ``sums_rows``: the result is
    a sum of per-row terms over the step's counts, so a row whose per-token losses are 0 adds 0
    (every built-in aggregation; it lets training skip zero-advantage rows, see
    ``register_policy_losses``). ``implements``: the aggregation whose reference fixtures ``rlhf
    plugins check`` runs it on (``"token_mean"``, ...).

    ``aggregate(loss, loss_mask, norm) -> scalar tensor``: ``loss`` and ``loss_mask``
    (float 0/1) are one micro-batch ``(B, A)``; ``norm`` is an ``rlhf.core.types.LossNorm``
    with counts over the whole optimizer step (all micro-batches and data-parallel ranks):
    ``num_tokens``, ``num_sequences`` (with at least one loss token) and
    ``max_new_tokens`` (or ``None`` when the run has no fixed budget). Return this
    micro-batch's share of the step loss: the sum of the returns over the step must equal the
    step loss, so the gradient does not depend on how the step is split.
    """


@hookspec
def register_algorithms(register: Register) -> None:
    """Register algorithm presets (``--algo NAME``).

    ``register(name, preset)`` with ``preset`` an ``rlhf.core.types.AlgorithmPreset`` naming
    the advantage estimator, policy loss, KL estimator, where KL goes (``"reward"``,
    ``"loss"`` or ``"none"``), β and the loss aggregation. Every piece stays overridable by
    its own flag.
    """


@hookspec
def register_rewards(register: Register) -> None:
    """Register reward sources usable as ``--reward NAME``.

    ``register(name, reward, *, batched=None, is_async=None)``. ``reward`` is a function (or
    callable object) called by signature: it receives only the parameters it declares, from
    ``prompts``, ``completions``, ``labels``, ``queries`` (prompt + completion),
    ``completion_ids`` and every dataset column by name. It returns one score per sample (a
    list, a tensor, or a dict with ``rewards``); ``None`` means no score. ``batched`` and
    ``is_async`` are detected from the signature when left as ``None``.
    """


@hookspec
def register_sample_filters(register: Register) -> None:
    """Register sample filters (``--filter-groups`` with ``--sample-filter NAME``).

    - ``register(name, sample_filter, *, config_cls=None)``.
    - ``sample_filter(groups, config) -> keep``: ``groups`` is the step's rollout as a list of
      prompt groups, each the list of its n scored ``rlhf.core.types.Trajectory`` (``reward``:
      the total after reward shaping, None when dropped; ``rewards``: per source; ``score``: the
      reward functions' OpenRLHF ``scores`` when they gave them, else the total before shaping;
      ``finish_reason``, ``num_policy_tokens``, ``columns``, ``info``).
    - Returns one bool per group, decided from that group's contents (not its position): False
      drops the whole group, and the loop samples new prompts until ``--prompts-per-step`` groups
      are kept (at most ``--max-filter-rounds`` rounds).
    - ``config``: an instance of ``config_cls`` (its settings ``--sample-filter.<field>``, and
      the plain flags it declares with ``short_flags``, as ``dynamic``'s ``--filter-range``) or None.
    - Called on the main process only; must be deterministic.
    """


@hookspec
def register_reward_shapings(register: Register) -> None:
    """Register reward shapings (``--reward-shaping NAME``, or the shaping's own flag).

    - ``register(name, shaping, *, config_cls=None, short_flags=(), enabled_by=None)``;
      ``enabled_by``: a setting whose flag turns the shaping on when given (``overlong``
      declares ``short_flags=("overlong_buffer", ...)``, ``enabled_by="overlong_buffer"``, so
      ``--overlong-buffer 8`` is all a user types).
    - ``shaping(trajectories, rewards, config) -> (rewards, metrics)``: ``rewards`` is each
      trajectory's total reward after the reward sources (None: the sample is dropped from the
      loss; keep it None); return the shaped list and a dict of scalar metrics (namespaced, e.g.
      ``overlong/penalized``).
    - Trajectories give lengths (``num_policy_tokens``: tokens the policy generated, never
      environment tokens), ``finish_reason`` ("length" when cut by the limit) and everything a
      reward sees.
    - ``config``: an instance of ``config_cls`` or None. The shapings of a run share one
      settings namespace, ``--reward-shaping.<field>``: each receives the settings its class
      declares, and run fields (``max_new_tokens``, ...).
    - Shapings run in this order: those turned on by their flag, by name (``overlong``,
      ``truncation``), then those of ``--reward-shaping``, in the order given.
    """


@hookspec
def register_envs(register: Register) -> None:
    """Register rollout environments (``--env NAME``; ``--env module:Class`` needs no plugin).

    - ``register(name, env_cls, *, config_cls=None, multi_turn=True, gives_rewards=True,
      needs_labels=False)``; ``multi_turn``: episodes may take several model turns (``single_turn``
      declares False); ``gives_rewards``: step rewards can train a model without ``--reward`` (a
      run with an env that declares False must have a reward source); ``needs_labels``: it checks
      answers against the label (a run without ``--label-key`` is refused). A ``module:Class`` env
      may declare them (and ``config_cls``) as class attributes, read once when it is resolved.
    - One instance per trajectory: ``env_cls()``, or ``env_cls(config)`` with a ``config_cls``.
    - ``reset(prompt, label, **columns) -> str | None``: text appended after the prompt, or
      ``None``. ``columns`` are the other dataset columns; only those ``reset`` declares are
      passed, unless it takes ``**columns``.
    - After each model turn, ``step(action_text) -> StepResult`` (``rlhf.core.types.StepResult(
      observation, reward, done, info, stop)``); ``action_text`` is the turn's decoded text
      including the stop string that ended it. The observation is appended with loss mask 0;
      ``stop`` lists stop strings for the next turn (besides EOS and the run's own); an optional
      class attribute ``stop`` gives those of the first turn, and ``blocking = False`` runs a
      cheap env's sync methods inline instead of in a worker thread (both read from the class
      once, where it is resolved).
    - The trajectory reward is the sum of the step rewards plus the reward sources'. The episode
      ends when ``done`` is true, at ``--max-turns`` or when the token budget is spent;
      ``close()`` is then called if the env's class defines one.
    - ``reset``, ``step`` and ``close`` may be ``async def`` (a slow sync method blocks every
      trajectory).
    - A label that is a dict (or a JSON object string) with an ``env_func`` key routes its sample
      to that env (name or ``module:Class``), which receives the label as a dict.
    - The whole contract: ``rlhf.core.protocols.environment``; ``rlhf plugins check NAME`` runs a scripted
      episode (actions from the class's ``sample_actions``).
    """


@hookspec
def register_agents(register: Register) -> None:
    """Register agents (``--agent NAME``; ``--agent file.py:fn`` or ``module:fn`` needs no plugin).

    - ``register(name, solve, *, config_cls=None)``. An agent is a function, sync or ``async``:
      ``solve(sample, endpoint) -> float | AgentResult | None`` (``rlhf.core.protocols.agent``), or
      ``solve(sample, endpoint, config)`` with a ``config_cls`` (its fields are ``--agent.<field>``).
    - ``sample``: the dataset row, every column (the ``--input-key`` column as given: a string or chat
      messages). ``endpoint`` (``rlhf.api.Endpoint``): ``base_url``, an OpenAI-compatible ``.../v1``
      URL that belongs to this one trajectory, ``api_key``, ``model``, and ``openai()`` /
      ``async_openai()`` for configured clients of the ``openai`` package.
    - Each of the n samples of a prompt is one call, bounded by ``--agent.timeout-s``. Its return is
      the trajectory's reward (``None``: the ``--reward`` sources score it). A call that raises or times
      out is a failed trajectory (``outcome`` ``agent_error`` / ``timeout``), never a reward of 0.
    - Everything the agent sends through the endpoint is recorded token for token
      (docs/agents.md): the model's own tokens are never re-tokenised.
    """


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers (``--tool-parser NAME``) for the agent endpoint.

    - ``register(name, parse)``; ``parse(text) -> rlhf.api.ParsedTurn`` (``content``, ``tool_calls`` in
      OpenAI's shape, ``error``): ``text`` is the completion decoded with its special tokens.
    - A completion it cannot read is answered with the raw text as content and a recorded parse
      failure (``ParsedTurn(content=text, error=...)``): a parser never raises on model output.
    - Optional, for streamed answers: ``parse.stream_start`` (the text that starts a call: content
      streams up to it) and ``parse.stream_calls(text)`` (the calls of a completion so far, each
      ``{"id", "name", "arguments", "end"}``, only ever growing, ending as ``parse`` reads the whole):
      with both, tool calls stream argument by argument; without, each call is sent whole at the end.
    - The whole contract: ``rlhf.core.protocols.tool_parser``.
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model adapters (``--model-adapter NAME``).

    - ``register(name, adapter_cls, *, roles=("policy", "reference", "critic", "reward"),
      config_cls=None, merge_setting=None)``; ``adapter_cls`` implements
      ``rlhf.core.protocols.adapter.ModelAdapter`` (``ModelAdapterBase`` gives ``save`` and
      ``save_critic``).
    - ``merge_setting``: the name of a bool setting of ``config_cls`` that makes ``save`` also
      write the trained adapter merged into full weights, in ``out_dir/merged`` (a directory
      ``from_pretrained`` loads; an adapter that trains every weight writes none). Commands that
      continue from a run's model (``rlhf iterate``) turn it on unless the user set it.
    - One instance per process, ``adapter_cls(config)`` (``config``: an instance of ``config_cls``
      with the user's ``--model-adapter.NAME`` settings and its run fields, or None).
    - ``adapter.load_tokenizer(ref)``, then ``adapter.load(ref, role=ROLE)`` for each role the run
      needs, ``policy`` first, on the same instance; ``ref`` is a local directory or a hub name.
    - ``policy`` and ``reference`` are causal LMs (``model(input_ids, attention_mask).logits``
      and ``generate``). The reference is frozen and may share the policy's weights (LoRA: the
      policy with its adapter switched off), so it must not change the policy's trainability or
      mode, and training the policy must not change the reference's outputs.
    - ``critic`` (and ``reward``) return a module with ``forward(input_ids, attention_mask) ->
      values (B, T)`` float32, the value of the state ending at each token.
    - At the end of a run ``adapter.save(model, tokenizer, out_dir)`` (optional; default
      ``save_pretrained``) writes the final policy, and with ``--save-critic``
      ``adapter.save_critic(model, tokenizer, out_dir)`` (optional; default the critic's
      ``save_pretrained``) the critic.
    """


@hookspec
def register_rollout_engines(register: Register) -> None:
    """Register rollout (generation) engines (``--engine NAME``).

    - ``register(name, engine_cls, *, needs_gpu=False, continuous_batching=False, config_cls=None)``;
      ``engine_cls`` implements ``rlhf.core.protocols.rollout.RolloutEngine``.
    - ``engine_cls(model, tokenizer, config)`` with the policy model.
    - ``generate(prompts, *, n, params) -> list[Generation]``: ``prompts`` are token-id lists,
      ``params`` an ``rlhf.core.protocols.rollout.SamplingParams``; ``n`` completions per prompt,
      contiguous (``[p0s0 .. p0s(n-1), p1s0, ...]``), each an ``rlhf.core.protocols.rollout.Generation``
      (tokens with EOS when generated, finish reason, and per-token log-probs when
      ``params.return_logprobs``: asked for when the policy loss reads them; ``params.logprobs_if_free``
      asks for them where they cost no memory beyond sampling's, for tokens.jsonl (``--log-tokens``
      above 0, its default): report them, or none, never zeros).
    - Weights: an engine whose ``shares_weights`` attribute is True reads the policy's weights in
      place; otherwise the runtime calls ``load_weights()`` after each optimizer step (take the
      weights from the policy module the engine was built with; ``load_weights(state)`` loads the
      given full weights instead). Such an engine should prove after each load that it holds what
      it was given, as the ``vllm`` engine does (``rlhf.api.weight_checksum``: exact checksums;
      raise ``WeightSyncError`` naming the tensor), unless its config's run field
      ``verify_weight_sync`` is False, and bound the load by ``weight_sync_timeout_s``
      (``rlhf.api.sync_deadline``).
    - ``continuous_batching=True``: the class also implements
      ``rlhf.core.protocols.rollout.ContinuousEngine`` (checked with the registration):
      ``async generate_one(prompt_ids, params) -> Generation`` joins one request to the running
      decode batch (``params.seed`` seeds its own random stream), and ``continuous_for(params)``
      says whether a rollout sampled with ``params`` goes that way. Multi-turn rollouts then run
      each trajectory on its own; other engines go turn by turn through ``generate``.
    """


@hookspec
def register_train_backends(register: Register) -> None:
    """Register training backends (``--backend NAME``).

    - ``register(name, backend_cls, *, needs_gpu=False, offloads_state=False, sharding_setting=None,
      shards_weights=False, config_cls=None)``; ``backend_cls`` implements
      ``rlhf.core.protocols.backend.TrainBackend`` (subclass ``TrainBackendBase`` for the defaults).
    - ``shards_weights``: a bool, or a function of the backend's config object (``deepspeed``:
      ``zero_stage == 3``), saying before any model loads what the instances' ``shards_weights``
      will be, so a run checks what needs whole weights (``--async``, multi-turn rollouts over
      several ranks) up front; an instance that disagrees stops the run.
    - ``sharding_setting``: the name of the setting of ``config_cls`` that chooses how much the
      backend shards over ranks (``deepspeed``: ``zero_stage``); messages that need whole weights
      on every rank (``--async``, multi-turn rollouts on sharded weights) tell the user to lower it.
    - ``backend_cls(model, config)`` per trained model (the config's run fields ``lr``,
      ``total_steps``, ``micro_batch_size`` are that model's).
    - Per micro-batch ``backward(loss)``, on a loss from a forward through ``train_module``: each
      micro-batch loss is already its share of the step loss, so gradients add up; over ranks
      the backend sums them.
    - Per optimizer step ``step() -> {"grad_norm", "lr", "skipped"}``: clip, then step unless the
      gradient is NaN/inf; gradients are cleared either way. ``zero_grad()`` drops a step.
    - Checkpoints: ``state_dict()`` / ``load_state_dict()`` (main rank), or with ``shards_state``
      ``save_checkpoint(dir)`` / ``load_checkpoint(dir)`` on every rank.
    - With ``offloads_state``: ``offload_state(params) -> bytes`` and ``reload_state()``
      (``--offload-train-state``, around each generation): the training state off the device and
      back exactly (the parameters too when ``params`` and the backend shards them).
    - With ``shards_weights`` every forward is a collective (ranks generate in lockstep) and
      exports gather the weights inside ``full_weights()``.
    """


@hookspec
def register_objectives(register: Register) -> None:
    """Register offline training objectives (``rlhf fit --objective NAME``; SFT, DPO, ... are built-ins).

    - ``register(name, objective_cls, *, config_cls=None, needs_reference=False,
      needs_teacher=False, head="lm", default_lr=1e-5, command=False, example=None,
      preference_strength=None)``; ``objective_cls`` implements
      ``rlhf.core.protocols.objective.Objective`` (subclass ``ObjectiveBase`` for the optional parts).
    - One instance, ``objective_cls(config)`` (``config``: an instance of ``config_cls`` with the
      user's ``--objective.NAME`` settings, or None).
    - ``columns()``; ``encode(row, text)`` per dataset row (an example; raise ``SkipExample`` or
      ``BadRow``); per optimizer step ``step_examples(examples)``; ``collate(examples,
      pad_token_id)`` per micro-batch (a dict of tensors); optionally ``step_statistics(models,
      batch)`` (sums over the whole step, passed on as ``stats``).
    - ``loss(models, batch, stats) -> (loss, metrics)``: the mean loss over the micro-batch's
      ``units(batch)``, which the loop scales by units / step units, so the step gradient does
      not depend on micro-batch size or rank count.
    - ``models`` (``rlhf.core.protocols.objective.FitModels``): ``model`` (the trained model),
      ``reference`` (with ``needs_reference``: the frozen start, or with LoRA the adapter
      switched off), ``teacher`` (with ``needs_teacher``: ``--teacher``).
    - ``head``: ``"lm"`` trains a causal LM, ``"score"`` a model whose forward returns one value
      per position ``(B, T)`` and which is saved as a one-label sequence classifier.
      ``default_lr``: the learning rate without ``--lr``. ``command``: also offer ``rlhf NAME``
      with the objective's settings as plain flags (a name that is already a command is refused).
      ``example``: one command line using it, shown by ``rlhf NAME --help``.
    - ``preference_strength``: the name of the setting of ``config_cls`` that holds how strongly
      the objective keeps the policy near its reference (``dpo``: ``beta``). Declaring it says the
      objective learns from preference pairs (``prompt``, ``chosen``, ``rejected``) against a
      reference, so ``rlhf iterate --objective NAME`` can train each round with it and set that
      setting from ``--beta``.
    - At the end, ``final_statistics`` and ``output_config(stats)`` add entries to the saved
      ``config.json``.
    - The whole contract: ``rlhf.core.protocols.objective``; the math of the built-ins: ``rlhf.objectives``.
    """


@hookspec
def register_commands(cli: click.Group) -> None:
    """Add click commands to the ``rlhf`` command line.

    Called once when the command line starts, after the built-in commands exist. Add with
    ``cli.add_command(...)`` or the ``@cli.command()`` decorator. A command whose name is
    already taken is refused and reported; it never replaces a built-in.
    """


# --- lifecycle hooks ----------------------------------------------------------------------


@hookspec
def on_run_start(run: RunInfo) -> None:
    """A run starts (or resumes).

    Called once, after models, plugins and the run directory are set up and before the first
    rollout. ``run`` is an ``rlhf.core.types.RunInfo``: ``config`` (the resolved config as a
    dict), ``out_dir`` (the run directory), ``start_step`` (0, or the step resumed from),
    ``total_steps`` and ``plugins`` (the fingerprint). A run owns only the files it records:
    a plugin that writes into the run directory names its file with ``run.claim(name)`` (which
    returns its path), a JSON-lines log with ``run.claim(name, log=True)``. Before this call
    the run's logs are cut back to their length when the checkpoint resumed from was written
    (a resumed run logs the later steps again), so a logger may simply append to its own;
    files the run did not record (a user's, beside the run) are never touched.
    """


@hookspec
def on_rollout_end(run: RunInfo, step: int, trajectories: list[Trajectory]) -> None:
    """A rollout batch was generated (after environments, before rewards).

    ``trajectories`` is the list of ``rlhf.core.types.Trajectory`` of this step, n samples of
    each prompt contiguous. Implementations may edit fields in place (``info``, text) but must
    keep the list's length and order.
    """


@hookspec
def on_rewards(run: RunInfo, step: int, trajectories: list[Trajectory], rewards: torch.Tensor) -> None:
    """Rewards of a rollout batch were computed (before advantages).

    ``rewards`` is the combined reward per trajectory, float32 ``(B,)``, 0 for a trajectory whose
    reward was skipped (``trajectory.reward`` None; it trains nothing whatever is written here);
    implementations may edit it in place (e.g. a length penalty). Per-source scores are in
    ``trajectory.rewards``.
    """


@hookspec
def on_step_end(run: RunInfo, step: int, metrics: dict[str, Any]) -> None:
    """A training step finished (optimizer steps done, weights synced to the rollout engine).

    ``metrics`` maps namespaced keys (``reward/mean``, ``loss/policy``, ``time/rollout``,
    ...) to floats. Loggers write it; implementations may add keys.
    """


@hookspec
def on_eval(run: RunInfo, step: int, metrics: dict[str, Any]) -> None:
    """An evaluation on ``--eval-data`` finished after ``step`` completed steps (0: before the
    first). ``metrics`` are the ``eval/*`` figures (the built-in logger writes them as their own
    row of metrics.jsonl, ``{"step": step, ...}``)."""


@hookspec
def on_checkpoint(run: RunInfo, step: int, path: Path) -> None:
    """A checkpoint of ``step`` was written completely to the directory ``path``."""


@hookspec
def on_run_end(run: RunInfo, status: str) -> None:
    """A run ended; ``status`` is ``"completed"``, ``"failed"`` or ``"interrupted"``.

    Called once, also when the run fails, so loggers can flush and close.
    """
