"""The agent endpoint: an OpenAI-compatible HTTP server in front of the rollout engine (docs/agents.md).

It listens on 127.0.0.1 (a random port) with a random key per run, on an event loop thread of its
own in the process that holds the engine; requests go to the engine's ``generate_one`` (continuous
batching: every agent's request joins one decode batch) or, for an engine without it, one
``generate`` at a time. Each trajectory gets its own path, ``/t/<id>/v1``, so every request maps to
the `TrajectoryRecord` that records it token for token (`rlhf.runtime.agents.recording`).

    POST /t/<id>/v1/chat/completions   messages (system, user, assistant, tool), tools, tool_choice
                                       auto/none, max_tokens / max_completion_tokens, stop, logprobs /
                                       top_logprobs (k <= 20), stream
    POST /t/<id>/v1/completions        prompt as text or token ids (the response adds token ids),
                                       logprobs (true or k), stream
    GET  /t/<id>/v1/models

The run's sampling settings always apply (`rlhf.runtime.agents.requests.check_sampling`); each
request samples from a random stream seeded by the rollout's seed, the trajectory's index and the
request's ordinal in that trajectory. A streamed answer (`AgentEndpoint._stream`) sends content
and tool-call deltas as the engine samples each token (``generate_one``'s optional ``on_token``;
`AnswerStream` holds back what may still change and gives each chunk the log-probs of the tokens
whose text it releases), ``top_logprobs`` come from the engine's sampling distribution
(``generate_one``'s optional ``top_logprobs``); an engine without them sends the chunks when the
answer ends and reports the sampled token alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from rlhf.core.protocols.agent import Endpoint
from rlhf.core.protocols.rollout import SamplingParams
from rlhf.runtime.agents.recording import Prompt, TrajectoryRecord
from rlhf.runtime.agents.requests import (BadRequest, RunSampling, budget, check_messages, check_sampling,
                                          check_tools, legacy_top_logprobs, prompt_of, stop_strings, top_logprobs)
from rlhf.runtime.agents.logprobs import (Sampled, chat_logprobs, legacy_logprobs, sampled_of, text_offsets,
                                          token_ends)
from rlhf.runtime.agents.streaming import AnswerStream, Chunk
from rlhf.runtime.agents.template import ChatTemplate


@dataclass(eq=False)
class _Open:
    """One trajectory the endpoint serves."""

    record: TrajectoryRecord
    index: int
    rollout_seed: int
    ordinal: int = 0
    errors: list[str] = field(default_factory=list)  # requests answered 4xx/5xx
    generating: set = field(default_factory=set)  # its requests' generation tasks in flight


def request_seed(rollout_seed: int, trajectory: int, ordinal: int) -> int:
    """The seed of one request: a hash of the rollout's seed, the trajectory's index and its ordinal."""
    digest = hashlib.blake2b(f"agent/{rollout_seed}/{trajectory}/{ordinal}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class AgentEndpoint:
    """The server; `open` gives one trajectory its `Endpoint` and `TrajectoryRecord`."""

    def __init__(self, engine: Any, tokenizer: Any, parser: Any, run: RunSampling, *, model_name: str,
                 continuous: bool):
        self.engine, self.parser, self.run, self.model_name = engine, parser, run, model_name
        self.template = ChatTemplate(tokenizer, getattr(engine, "eos_ids", None))
        self.continuous = continuous
        self.offers = engine_offers(engine) if continuous else {"on_token": False, "top_logprobs": False}
        self.key = "rlhf-" + secrets.token_urlsafe(24)
        self.open_trajectories: dict[str, _Open] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.port: int | None = None
        self._runner: Any = None
        self._one_at_a_time = threading.Lock()

    # --- lifetime ----------------------------------------------------------------------------

    def start(self) -> None:
        if self.thread is not None:
            return
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self._listen())
            except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                failure.append(exc)
                started.set()
                return
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, name="rlhf-agent-endpoint", daemon=True)
        self.thread.start()
        started.wait()
        if failure:
            raise failure[0]

    async def _listen(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/t/{trajectory}/v1/chat/completions", self._chat)
        app.router.add_post("/t/{trajectory}/v1/completions", self._completions)
        app.router.add_get("/t/{trajectory}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self.thread is None or self.loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.thread = self.loop = None

    def open(self, index: int, rollout_seed: int, policy_version: int | None = None
             ) -> tuple[str, Endpoint, TrajectoryRecord]:
        """A new trajectory: its id, its endpoint (its own ``/t/<id>/v1`` URL) and its record, which
        stamps every sampled token with ``policy_version`` (the steps the serving weights have taken)."""
        self.start()
        trajectory = secrets.token_hex(8)
        record = TrajectoryRecord(self.template, policy_version)
        self.open_trajectories[trajectory] = _Open(record, index, rollout_seed)
        return trajectory, Endpoint(base_url=f"http://127.0.0.1:{self.port}/t/{trajectory}/v1", api_key=self.key,
                                    model=self.model_name), record

    def close(self, trajectory: str) -> list[str]:
        """Stop serving a trajectory and end what it still has generating (an agent abandoned at its
        timeout may have a request in flight: none may sample while the policy trains); returns the
        errors its requests were answered with."""
        found = self.open_trajectories.pop(trajectory, None)
        if found is None:
            return []
        if found.generating and self.loop is not None:
            asyncio.run_coroutine_threadsafe(self._end(found), self.loop).result()
        return found.errors

    async def _end(self, opened: _Open) -> None:
        tasks = list(opened.generating)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not self.continuous:  # a generate already running in its thread cannot be stopped: wait for it
            await asyncio.get_running_loop().run_in_executor(None, self._wait_for_generate)

    def _wait_for_generate(self) -> None:
        with self._one_at_a_time:
            pass

    # --- handlers ----------------------------------------------------------------------------

    async def _models(self, request: Any) -> Any:
        return await self._answer(request, self._model_list)

    async def _chat(self, request: Any) -> Any:
        return await self._answer(request, self._chat_completion, wants_body=True)

    async def _completions(self, request: Any) -> Any:
        return await self._answer(request, self._text_completion, wants_body=True)

    async def _answer(self, request: Any, handle: Any, *, wants_body: bool = False) -> Any:
        from aiohttp import web

        opened = None
        try:
            if request.headers.get("Authorization", "") != f"Bearer {self.key}":
                raise BadRequest("wrong or missing API key: use the endpoint's api_key", status=401,
                                 code="invalid_api_key", kind="authentication_error")
            opened = self.open_trajectories.get(request.match_info["trajectory"])
            if opened is None:
                raise BadRequest("no trajectory is served at this path (it ended, or the URL is not an "
                                 "endpoint.base_url)", status=404, code="not_found")
            body = None
            if wants_body:
                try:
                    body = json.loads(await request.read())
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise BadRequest(f"the request body is not JSON: {exc}") from None
                if not isinstance(body, dict):
                    raise BadRequest("the request body must be a JSON object")
                if body.get("model") not in (None, self.model_name):
                    raise BadRequest(f"unknown model {body.get('model')!r}; this endpoint serves "
                                     f"{self.model_name!r}", code="model_not_found")
            result = await handle(opened, body)
            if isinstance(result, web.StreamResponse):
                return result
            if callable(result):  # a streamed answer
                return await result(request)
            return web.json_response(result)
        except BadRequest as exc:
            if opened is not None:
                opened.errors.append(f"{exc.status}: {exc.message}")
            return web.json_response(exc.body(), status=exc.status)
        except Exception as exc:  # noqa: BLE001 - the engine failed: the agent gets a 500, the run its error
            message = f"{type(exc).__name__}: {exc}"
            if opened is not None:
                opened.errors.append(f"500: {message}")
            return web.json_response({"error": {"message": message, "type": "server_error", "code": "engine_error",
                                                "param": None}}, status=500)

    async def _model_list(self, opened: _Open, body: None) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "rlhf"}]}

    async def _chat_completion(self, opened: _Open, body: dict[str, Any]) -> Any:
        check_sampling(body, self.run)
        messages = check_messages(body)
        tools, parse_tools = check_tools(body)
        stops = stop_strings(body)
        top = top_logprobs(body)
        try:
            prompt = opened.record.chat_prompt(messages, tools)
        except Exception as exc:  # a template that cannot render these messages
            raise BadRequest(f"the policy's chat template cannot render these messages: {type(exc).__name__}: "
                             f"{exc}", code="template_error") from None
        extra_stop = (self.template.marker,) if self.template.marker and not self.template.marker_is_eos else ()
        params = self._params(opened, prompt, body, stops + extra_stop)
        ident, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        if body.get("stream"):
            return lambda request: self._stream(request, opened, prompt, params, body, Turn(
                stops=stops, parse_tools=parse_tools, top=top, ident=ident, created=created))
        generation = await self._generate(opened, prompt, params, top=top)
        answer = self._chat_reply(opened, prompt, generation, stops, parse_tools)
        logprobs = chat_logprobs(self.template, sampled_of(generation, top), top) if body.get("logprobs") else None
        return {"id": ident, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "message": answer.message, "finish_reason": answer.finish,
                             "logprobs": logprobs}], "usage": answer.usage}

    def _chat_reply(self, opened: _Open, prompt: Prompt, generation: Any, stops: tuple[str, ...],
                    parse_tools: bool) -> Answer:
        """A chat completion's message (content and tool calls, parsed), recorded."""
        ids = generation.token_ids
        text = self._visible_text(ids, generation.stop_string if generation.stop_string in stops else None)
        parsed = self.parser(text) if parse_tools else None
        if parsed is not None and parsed.error:
            opened.record.parse_failures.append(parsed.error)
        content = text if parsed is None else parsed.content
        calls = [] if parsed is None else list(parsed.tool_calls)
        reply = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        finish = "tool_calls" if calls else ("length" if generation.finish_reason == "length" else "stop")
        opened.record.record(prompt, ids, generation.logprobs, reply, finish)
        usage = {"prompt_tokens": len(prompt.ids) - len(ids), "completion_tokens": len(ids),
                 "total_tokens": len(prompt.ids)}
        return Answer(text, reply, finish, parsed is not None and parsed.error is not None, usage)

    async def _text_completion(self, opened: _Open, body: dict[str, Any]) -> Any:
        check_sampling(body, self.run)
        ids_in = prompt_of(body, self.template.ids)
        stops = stop_strings(body)
        top = legacy_top_logprobs(body)
        prompt = opened.record.token_prompt(ids_in)
        params = self._params(opened, prompt, body, stops)
        ident, created = "cmpl-" + secrets.token_hex(12), int(time.time())
        if body.get("stream"):
            return lambda request: self._stream(request, opened, prompt, params, body, Turn(
                stops=stops, parse_tools=False, top=top, ident=ident, created=created, chat=False))
        generation = await self._generate(opened, prompt, params, top=top)
        answer = self._text_reply(opened, prompt, generation)
        ids = list(generation.token_ids)
        logprobs = legacy_logprobs(self.template, sampled_of(generation, top), top, text_offsets(
            token_ends(self.template, ids), 0, len(ids), len(answer.text))) if body.get("logprobs") else None
        choice = {"index": 0, "text": answer.text, "finish_reason": answer.finish, "token_ids": ids,
                  "prompt_token_ids": list(ids_in), "logprobs": logprobs}
        return {"id": ident, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [choice], "usage": answer.usage}

    def _text_reply(self, opened: _Open, prompt: Prompt, generation: Any) -> Answer:
        """A text completion's text, recorded."""
        ids = generation.token_ids
        text = self._visible_text(ids, generation.stop_string)
        finish = "length" if generation.finish_reason == "length" else "stop"
        opened.record.record(prompt, ids, generation.logprobs, None, finish)
        prompt_tokens = len(prompt.ids) - len(ids)
        return Answer(text, {"content": text}, finish, False, {
            "prompt_tokens": prompt_tokens, "completion_tokens": len(ids), "total_tokens": prompt_tokens + len(ids)})

    def _params(self, opened: _Open, prompt: Prompt, body: dict[str, Any], stops: tuple[str, ...]) -> SamplingParams:
        """The request's sampling: the run's settings, its budget and the seed of its ordinal."""
        try:
            limit = budget(body, len(prompt.ids), self.run)
        except BaseException:
            opened.record.abandon(prompt)
            raise
        ordinal, opened.ordinal = opened.ordinal, opened.ordinal + 1
        return SamplingParams(max_new_tokens=limit, temperature=self.run.temperature, top_p=self.run.top_p,
                              top_k=self.run.top_k, repetition_penalty=self.run.repetition_penalty,
                              stop=stops, return_logprobs=True,
                              seed=request_seed(opened.rollout_seed, opened.index, ordinal))

    async def _generate(self, opened: _Open, prompt: Prompt, params: SamplingParams, *, on_token: Any = None,
                        top: int = 0) -> Any:
        """The completion of ``prompt``; ``on_token(id, logprob, alternatives)`` as tokens are sampled and
        ``top`` alternatives per token where the engine offers them (`engine_offers`)."""
        try:
            ids = list(prompt.ids)
            if self.continuous:
                extra = {**({"on_token": on_token} if on_token is not None and self.offers["on_token"] else {}),
                         **({"top_logprobs": top} if top and self.offers["top_logprobs"] else {})}
                work = self.engine.generate_one(ids, params, **extra)
            else:
                work = asyncio.get_running_loop().run_in_executor(None, self._generate_alone, ids, params)
            task = asyncio.ensure_future(work)
            opened.generating.add(task)
            try:
                return await task
            finally:
                opened.generating.discard(task)
        except BaseException:
            opened.record.abandon(prompt)
            raise

    def _generate_alone(self, ids: list[int], params: SamplingParams) -> Any:
        with self._one_at_a_time:
            return self.engine.generate([ids], n=1, params=replace(params, seed=None))[0]

    def _visible_text(self, ids: list[int], stop: str | None) -> str:
        """The completion as the client sees it: special tokens out, the end-of-turn and a stop string cut."""
        text = self.template.decode(ids, special=False)
        for cut in (stop, self.template.marker):
            if cut and text.endswith(cut):
                text = text[:-len(cut)]
        return text

    async def _stream(self, request: Any, opened: _Open, prompt: Prompt, params: SamplingParams,
                      body: dict[str, Any], turn: Turn) -> Any:
        """A streamed answer (server-sent events): content and tool-call deltas as the engine samples
        the tokens (where it offers ``on_token``; else all of them when it ends), each chunk with the
        log-probs of the tokens it releases (when asked for), then the finish reason (`AnswerStream`)."""
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        stream = AnswerStream(self.template, holdback=(*turn.stops, *(m for m in (self.template.marker,) if m)),
                              parser=self.parser if turn.parse_tools else None)
        sampled: list[Sampled] = []  # as the engine reported them; the generation's replace them at the end

        async def send(chunk: Chunk, finish_reason: str | None = None, length: int | None = None) -> None:
            logprobs = None
            if body.get("logprobs") and chunk.tokens:
                these = sampled[chunk.tokens.start:chunk.tokens.stop]
                logprobs = chat_logprobs(self.template, these, turn.top) if turn.chat else legacy_logprobs(
                    self.template, these, turn.top, text_offsets(
                        stream.text.ends, chunk.tokens.start, chunk.tokens.stop,
                        stream.text.ends[chunk.tokens.stop - 1] if length is None else length))
            if turn.chat:
                choice = {"index": 0, "delta": chunk.delta, "finish_reason": finish_reason, "logprobs": logprobs}
            else:  # /v1/completions: text pieces
                choice = {"index": 0, "text": chunk.delta.get("content", ""), "finish_reason": finish_reason,
                          "logprobs": logprobs}
            payload = {"id": turn.ident, "object": "chat.completion.chunk" if turn.chat else "text_completion",
                       "created": turn.created, "model": self.model_name, "choices": [choice]}
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())

        alternatives = bool(turn.top) and self.offers["top_logprobs"]
        tokens: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self._generate(
            opened, prompt, params, top=turn.top,
            on_token=lambda token, logprob, tops: tokens.put_nowait(Sampled(token, logprob,
                                                                            tops if alternatives else None))))
        try:
            if turn.chat:
                await send(Chunk({"role": "assistant", "content": ""}, range(0)))
            while not (task.done() and tokens.empty()):
                getter = asyncio.ensure_future(tokens.get())
                await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                sampled.append(getter.result())
                for chunk in stream.add(sampled[-1].token):
                    await send(chunk)
            try:
                generation = task.result()
            except BadRequest as exc:
                opened.errors.append(f"{exc.status}: {exc.message}")
                await response.write(f"data: {json.dumps(exc.body())}\n\n".encode())
                await response.write_eof()
                return response
            ids = list(generation.token_ids)
            answer = self._chat_reply(opened, prompt, generation, turn.stops, turn.parse_tools) if turn.chat \
                else self._text_reply(opened, prompt, generation)
            sampled[stream.released:] = sampled_of(generation, turn.top)[stream.released:]
            calls = None if answer.unreadable else answer.message.get("tool_calls", [])
            for chunk in stream.finish(ids, answer.message.get("content"), calls, len(answer.text)):
                await send(chunk, length=len(answer.text))
            await send(Chunk({}, stream.rest(len(ids))), answer.finish, length=len(answer.text))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except Exception as exc:  # the client left, the engine failed, or the parser streamed what it took back
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            opened.errors.append(f"500: {type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                error = {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error",
                                   "code": "engine_error", "param": None}}
                await response.write(f"data: {json.dumps(error)}\n\n".encode())
                await response.write_eof()
        return response


@dataclass(frozen=True)
class Answer:
    """A completion as the endpoint answers it (recorded by then)."""

    text: str  # its visible text: special tokens out, the end of turn and a stop string cut
    message: dict[str, Any]  # chat: role, content and tool calls; completions: the content
    finish: str
    unreadable: bool  # the tool parser could not read it (the content is the raw text)
    usage: dict[str, int]


@dataclass(frozen=True)
class Turn:
    """What a streamed chat completion needs besides its request."""

    stops: tuple[str, ...]
    parse_tools: bool
    top: int
    ident: str
    created: int
    chat: bool = True  # /v1/chat/completions (else /v1/completions)


def engine_offers(engine: Any) -> dict[str, bool]:
    """Which of ``generate_one``'s optional keywords the engine takes (`ContinuousEngine.generate_one`)."""
    import inspect

    try:
        parameters = inspect.signature(engine.generate_one).parameters
    except (AttributeError, TypeError, ValueError):
        return {"on_token": False, "top_logprobs": False}
    return {name: name in parameters for name in ("on_token", "top_logprobs")}
