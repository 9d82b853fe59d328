"""An OpenAI-compatible speculative-decoding server with live acceptance metrics.

    python -m serve_eval.server --draft runs/quickstart/train/best [--target smollm2-135m] \\
        [--k 3 | --adaptive] [--proposer draft|lookup|hybrid] [--lookup-shared-tokens N] \\
        [--port 8000] [--api-key KEY]

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (``stream: true`` for
server-sent events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text:
acceptance counters per draft position, server-wide and for the last ``--recent-requests``
requests). Binds 127.0.0.1 unless ``--host`` says otherwise; with ``--api-key`` (or
``EAGLE3_API_KEY``) every ``/v1`` call needs ``Authorization: Bearer KEY``.

Requests are served one at a time by a worker thread (batch-1 speculative decoding, the target's
and draft's KV caches per request) from a bounded queue: a full queue answers 503. Every bad
request is a 4xx with an OpenAI-style ``{"error": {"message", "type", "param"}}`` body naming the
reason. With ``--adaptive`` each request's chain depth follows its running acceptance and the
cost model measured at start-up (:mod:`serve_eval.adaptive`); depth 0 is plain decoding. With
``--proposer hybrid`` each round also continues the context where its last tokens occurred before
(:mod:`serve_eval.lookup`), in the same verified tree; ``--lookup-shared-tokens`` lets that lookup
continue from recent replies to other requests too (a capped index, counted in ``/metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import queue
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError as err:  # the core install trains and harvests; serving is an extra
    raise ImportError(f"serve_eval.server needs the [serve] extra: pip install -e '.[serve]' ({err})") from err

from eagle3.cli import add_dataclass_arguments, dataclass_from_args
from eagle3.config import SamplingConfig, add_target_arguments
from eagle3.conversations import ConversationError, check_messages, check_tools
from eagle3.errors import ConfigError, run_cli
from eagle3.target.chat import ChatFormat, ChatFormatError
from serve_eval.adaptive import AdaptiveDepth, AdaptiveSession, CostModel, measure_cost
from serve_eval.config import SpecConfig
from serve_eval.lookup import SharedLookup
from serve_eval.openai_api import BadRequest, ChatRequest, CompletionRequest, parse_body
from serve_eval.server_metrics import Metrics
from serve_eval.spec_decode import SpeculativeDecoder
from serve_eval.traffic import TrafficLog, rounds_of

# ---------------------------------------------------------------- text


class TextStream:
    """Incremental detokenisation with stop strings: ``push`` returns the text safe to send (never
    a half UTF-8 character, never text that may become a stop string) and whether a stop string
    was found (the text ends before it)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.used: int | None = None
        """With a stop string found: the tokens needed to produce the text before it."""

    def push(self, ids: Sequence[int]) -> tuple[str, bool]:
        self.ids.extend(ids)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (self.text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            self.text = self.text[:end]
            self.used = next(n for n in range(len(self.ids) + 1)
                             if len(self.tokenizer.decode(self.ids[:n], skip_special_tokens=True)) >= end)
            return self._emit(max(end, self.sent)), True
        safe = len(self.text.rstrip("\ufffd"))
        for s in self.stops:  # hold back a tail that could still grow into a stop string
            for j in range(min(len(s) - 1, safe), 0, -1):
                if self.text[:safe].endswith(s[:j]):
                    safe = min(safe, len(self.text[:safe]) - j)
                    break
        return self._emit(max(safe, self.sent)), False

    def finish(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        delta = self.text[self.sent:upto]
        self.sent = upto
        return delta


# ---------------------------------------------------------------- engine


@dataclass
class Job:
    request_id: str
    endpoint: str
    prompt: list[int]
    max_tokens: int
    params: SamplingConfig
    seed: int
    stops: list[str]
    emit: Callable[[dict[str, Any]], None]
    messages: list[dict[str, Any]] | None = None  # a chat request's, as checked (the traffic log's)
    tools: list[dict[str, Any]] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)


class _LiveDepth:
    """Wraps a fixed depth or an adaptive policy so every round reaches the metrics as it happens."""

    def __init__(self, k: int, adaptive: AdaptiveDepth | None, metrics: Metrics) -> None:
        self.k, self.adaptive, self.metrics = k, adaptive, metrics

    def choose(self) -> int:
        return self.adaptive.choose() if self.adaptive is not None else self.k

    def observe(self, depth: int, accepted: int, kept_depth: int | None = None, kept: int | None = None) -> None:
        if self.adaptive is not None:
            self.adaptive.observe(depth, accepted)  # learns from the target's acceptance
        self.metrics.observe_round(depth if kept_depth is None else kept_depth,  # reports what the reply kept
                                   accepted if kept is None else kept)


class Engine:
    """The decoder, its chat format and one worker thread draining a bounded job queue."""

    def __init__(self, decoder: SpeculativeDecoder, chat: ChatFormat, *, model_name: str, max_model_len: int,
                 default_max_tokens: int = 1024, adaptive: bool = False, cost: CostModel | None = None,
                 prior: Sequence[float] | None = None, max_queue: int = 256, recent_requests: int = 64,
                 traffic: TrafficLog | None = None, shared: SharedLookup | None = None,
                 capture: Any = None, follower: Any = None) -> None:
        self.decoder, self.chat, self.model_name, self.traffic = decoder, chat, model_name, traffic
        self.capture, self.follower = capture, follower
        self.tokenizer = chat.tokenizer
        self.max_model_len, self.default_max_tokens = max_model_len, default_max_tokens
        self.k = decoder.config.k if decoder.proposer is not None else 0
        if adaptive and (decoder.proposer is None or decoder.config.mode != "chain"
                         or decoder.config.proposer != "draft"):
            raise ConfigError("adaptive speculation needs a draft, mode=chain and proposer=draft")
        if shared is not None and not decoder.config.uses_lookup:
            raise ConfigError("--lookup-shared-tokens: the shared lookup index needs proposer=lookup or hybrid")
        self.shared = shared
        if adaptive and cost is None:
            raise ValueError("adaptive speculation needs a cost model")
        # every finished request's rounds become the next request's prior
        self.session = AdaptiveSession(cost, self.k, prior) if adaptive and cost is not None else None
        self.metrics = Metrics(decoder.max_depth, recent_requests, shared)
        self.metrics.watch_live(capture, follower)
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.ids = itertools.count(1)
        self.worker = threading.Thread(target=self._work, name="eagle3-engine", daemon=True)
        self.worker.start()

    # -- requests -> jobs

    def chat_messages(self, req: ChatRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """A chat request's messages and tools, as the template renders them (an agent's checked)."""
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                     **{k: v for k, v in (("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id),
                                          ("name", m.name)) if v is not None}}
                    for m in req.messages]
        if req.tools or any(m.role == "tool" or m.tool_calls for m in req.messages):  # an agent's request
            try:
                return check_messages(messages), check_tools(req.tools) if req.tools else None
            except ConversationError as err:
                raise BadRequest(f"messages: {err}", param="messages") from None
        return messages, None

    def prompt_ids(self, req: ChatRequest | CompletionRequest) -> list[int]:
        if isinstance(req, ChatRequest):
            messages, tools = self.chat_messages(req)
            agent = tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
            chat = self.chat.with_tools(tools) if agent else self.chat
            try:
                ids = chat.prompt_ids(messages)
            except ChatFormatError as err:
                raise BadRequest(f"messages: {err}", param="messages") from None
            except Exception as err:  # a template that rejects the conversation (roles out of order, ...)
                raise BadRequest(f"messages: the chat template cannot render them: {err}", param="messages") \
                    from None
            return ids
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (list, str)):
            if len(p) != 1:
                raise BadRequest("prompt: only one prompt per request is supported", param="prompt")
            p = p[0]
        if isinstance(p, str):
            ids = self.tokenizer(p, add_special_tokens=True)["input_ids"]
        else:
            ids = list(p)
            bad = [t for t in ids if not 0 <= t < self.decoder.target.vocab_size]
            if bad:
                raise BadRequest(f"prompt: token id {bad[0]} outside the vocabulary "
                                 f"[0, {self.decoder.target.vocab_size})", param="prompt")
        if not ids:
            raise BadRequest("prompt: empty", param="prompt")
        return ids

    def make_job(self, req: ChatRequest | CompletionRequest, endpoint: str,
                 emit: Callable[[dict[str, Any]], None]) -> Job:
        if req.n != 1:
            raise BadRequest("n: only n=1 is supported", param="n")
        if req.logprobs not in (None, False):
            raise BadRequest("logprobs: not supported", param="logprobs")
        if isinstance(req, CompletionRequest) and req.echo:
            raise BadRequest("echo: not supported", param="echo")
        prompt = self.prompt_ids(req)
        room = self.max_model_len - len(prompt)
        asked = req.max_completion_tokens if isinstance(req, ChatRequest) and req.max_completion_tokens else \
            req.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise BadRequest(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                             f"{len(prompt)} and {asked or 1} more were requested", param="max_tokens")
        max_tokens = asked if asked is not None else min(room, self.default_max_tokens)
        try:
            params = SamplingConfig(temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p)
        except ValueError as err:
            raise BadRequest(str(err)) from None
        seed = req.seed if req.seed is not None else secrets.randbits(31)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        logged = self.chat_messages(req) if self.traffic is not None and isinstance(req, ChatRequest) else (None, None)
        return Job(f"{prefix}-{next(self.ids)}-{secrets.token_hex(4)}", endpoint, prompt, max_tokens, params, seed,
                   stops, emit, *logged)

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise BadRequest("the server is busy: the request queue is full, retry later", status=503,
                             kind="server_error") from None
        self.metrics.queue_depth.set(self.jobs.qsize())

    def close(self) -> None:
        self.jobs.put(None)
        self.worker.join(timeout=30)
        if self.capture is not None:
            self.capture.close()

    # -- the worker

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.metrics.queue_depth.set(self.jobs.qsize())
            if job.cancelled.is_set():
                self.metrics.finish(job.request_id, job.endpoint, "cancelled", len(job.prompt), None,
                                    time.perf_counter() - job.queued_at)
                continue
            if self.follower is not None and self.follower.follow(self.decoder.set_draft):  # between requests
                self.metrics.version.set(self.follower.version)
            self.metrics.running.set(1)
            try:
                self._run(job)
            except Exception as err:  # the request fails, the server goes on
                try:
                    job.emit({"type": "error", "message": f"generation failed: {type(err).__name__}: {err}"})
                except RuntimeError:  # the event loop is gone (shutting down): nobody to tell
                    pass
                self.metrics.finish(job.request_id, job.endpoint, "error", len(job.prompt), None,
                                    time.perf_counter() - job.queued_at)
            finally:
                self.metrics.running.set(0)

    def _run(self, job: Job) -> None:
        text = TextStream(self.tokenizer, job.stops)
        hit_stop = False

        def on_tokens(ids: list[int]) -> bool:
            nonlocal hit_stop
            delta, hit_stop = text.push(ids)
            if delta:
                job.emit({"type": "delta", "text": delta})
            return not hit_stop and not job.cancelled.is_set()

        policy = None
        if self.decoder.proposer is not None and self.decoder.config.mode == "chain":
            adaptive = self.session.start() if self.session is not None else None
            policy = _LiveDepth(self.k, adaptive, self.metrics)
        version = self.follower.version if self.follower is not None else 0
        capture = self.capture is not None and self.capture.has_room()
        gen = self.decoder.generate(job.prompt, job.max_tokens, self.chat.stop_ids, job.params, job.seed,
                                    policy=policy, on_tokens=on_tokens, shared=self.shared, capture=capture)
        stats = gen.stats
        if self.shared is not None and not job.cancelled.is_set():
            self.shared.add(job.prompt, gen.tokens)
        if policy is None:
            for depth, accepted in zip(stats.depths or [0] * len(stats.accepted), stats.accepted, strict=True):
                self.metrics.observe_round(depth, accepted)
            self.metrics.target_forwards.inc(max(stats.target_forwards - len(stats.accepted), 0))
        elif policy.adaptive is not None and self.session is not None:
            self.session.finish(policy.adaptive)
        rest = text.finish()
        if rest:
            job.emit({"type": "delta", "text": rest})
        stopped = hit_stop or (gen.tokens and gen.tokens[-1] in self.chat.stop_ids)
        outcome = "cancelled" if job.cancelled.is_set() and not hit_stop else "ok"
        # tokens past a stop string were generated in the same round but are not the client's
        completion = text.used if hit_stop and text.used is not None else len(gen.tokens)
        self.metrics.finish(job.request_id, job.endpoint, outcome, len(job.prompt), stats,
                            time.perf_counter() - job.queued_at, completion)
        if self.traffic is not None and job.messages is not None and outcome == "ok":
            self.traffic.write(job.messages, job.tools, job.prompt, gen.tokens[:completion],
                               "stop" if stopped else "length", stats)
        job.emit({"type": "done", "finish_reason": "stop" if stopped else "length",
                  "prompt_tokens": len(job.prompt), "completion_tokens": completion,
                  "spec_decode": {"tau": round(stats.tau, 4),
                                  "accept_per_pos": [round(a, 4) for a in stats.acceptance_per_position()],
                                  "mean_depth": round(sum(stats.depths) / len(stats.depths), 3)
                                  if stats.depths else 0.0,
                                  "accepted_by": stats.accepted_by()}})
        self.metrics.observe_version(version, stats)
        if self.capture is not None and outcome == "ok":
            if gen.states is not None:  # None: the folder was full (counted when the request began)
                try:
                    self.capture.write(job.prompt, gen.tokens, gen.states, {
                        "draft_version": version, "finish_reason": "stop" if stopped else "length",
                        "greedy": job.params.greedy, "k": stats.proposed, "rounds": rounds_of(stats)})
                except Exception as err:  # a full disk: the request was served; capture skips it, counted
                    self.capture.paused += 1
                    print(f"capture: {job.request_id} not captured: {err}", file=sys.stderr)


# ---------------------------------------------------------------- HTTP


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> Any:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


def build_app(engine: Engine, api_key: str | None = None) -> Any:
    """The FastAPI application around ``engine``."""
    app = FastAPI(title="eagle3 speculative server")

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> Any:
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                      "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Any:
        return _error(400, str(exc.errors()[:1]))

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        if api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok" if engine.worker.is_alive() else "dead", "queue": engine.jobs.qsize()}

    @app.get("/metrics")
    async def metrics() -> Any:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "eagle3"}]}

    async def serve(request: Request, kind: type[BaseModel], endpoint: str) -> Any:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        def emit(event: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            req = parse_body(await request.body(), kind)
            if req.model is not None and req.model != engine.model_name:
                raise BadRequest(f"model: {req.model!r} is not served here (serving {engine.model_name!r})",
                                 param="model", status=404, kind="not_found_error")
            job = engine.make_job(req, endpoint, emit)
            engine.submit(job)
        except BadRequest as err:
            return _error(err.status, err.message, err.kind, err.param)
        created = int(time.time())
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(_sse(job, events, endpoint, engine.model_name, created, include_usage),
                                     media_type="text/event-stream")
        parts, done = [], None
        try:
            while done is None:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():  # the client left: free the worker
                        return _error(499, "client closed the request", "client_closed")
                    continue
                if event["type"] == "delta":
                    parts.append(event["text"])
                elif event["type"] == "error":
                    return _error(500, event["message"], "server_error")
                else:
                    done = event
        finally:
            job.cancelled.set()  # a client gone mid-request frees the worker (no-op once done)
        text = "".join(parts)
        usage = {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
                 "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}
        if endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": done["finish_reason"], "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": done["finish_reason"], "logprobs": None}
            obj = "text_completion"
        return JSONResponse({"id": job.request_id, "object": obj, "created": created, "model": engine.model_name,
                             "choices": [choice], "usage": usage, "spec_decode": done["spec_decode"]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await serve(request, ChatRequest, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await serve(request, CompletionRequest, "completion")

    return app


async def _sse(job: Job, events: asyncio.Queue[dict[str, Any]], endpoint: str, model: str, created: int,
               include_usage: bool) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"

    def chunk(delta: str | None, finish: str | None, role: bool = False) -> bytes:
        if endpoint == "chat":
            d: dict[str, Any] = {"role": "assistant", "content": ""} if role else \
                ({"content": delta} if delta is not None else {})
            choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        body = {"id": job.request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    try:
        if endpoint == "chat":
            yield chunk(None, None, role=True)
        while True:
            event = await events.get()
            if event["type"] == "delta":
                yield chunk(event["text"], None)
            elif event["type"] == "error":
                body = {"error": {"message": event["message"], "type": "server_error", "param": None, "code": None}}
                yield f"data: {json.dumps(body)}\n\n".encode()
                break
            else:
                yield chunk(None, event["finish_reason"])
                if include_usage:
                    usage = {"prompt_tokens": event["prompt_tokens"], "completion_tokens": event["completion_tokens"],
                             "total_tokens": event["prompt_tokens"] + event["completion_tokens"]}
                    body = {"id": job.request_id, "object": obj, "created": created, "model": model, "choices": [],
                            "usage": usage, "spec_decode": event["spec_decode"]}
                    yield f"data: {json.dumps(body)}\n\n".encode()
                break
        yield b"data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # the client went away: the worker stops this request at its next round


# ---------------------------------------------------------------- start-up


def draft_prior(meta: dict[str, Any], k: int) -> list[float] | None:
    """Conditional acceptance per depth from a draft's own held-out eval (``draft.json``), if any."""
    ev = meta.get("eval") or {}
    vals = [ev.get(f"eval/cond_acc_{i}") for i in range(k)]
    known = [float(v) for v in vals if isinstance(v, (int, float))]
    if not known:
        return None
    return [float(v) if isinstance(v, (int, float)) else known[-1] for v in vals]


def build_engine(args: argparse.Namespace) -> Engine:
    from serve_eval.eval_runs import load_pair_meta

    spec = dataclass_from_args(SpecConfig, args)  # checked before the models load
    if args.draft is None and spec.uses_draft:
        raise ConfigError(f"--draft: proposer={spec.proposer} needs a draft (proposer=lookup serves without one)")
    if args.lookup_shared_tokens and not spec.uses_lookup:
        raise ConfigError("--lookup-shared-tokens: the shared lookup index needs --proposer lookup or hybrid")
    if args.draft is None:
        from eagle3.target.model import load_target

        target, draft, meta = load_target(args.target, dtype=args.target_dtype, device=args.device), None, {}
    else:
        target, draft, meta = load_pair_meta(args.draft, args.target, args.target_dtype, args.device)
    decoder = SpeculativeDecoder(target, draft, spec)
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
    limit = int(getattr(target.model.config, "max_position_embeddings", 0) or 0) or 8192
    max_model_len = min(args.max_model_len, limit) if args.max_model_len else limit
    cost = None
    if args.adaptive or spec.uses_lookup:  # adaptive depths, and the lookup's branches, priced on this machine
        cost = measure_cost(decoder, args.k)
        decoder.cost_lookup(cost.verify_s)
        print(json.dumps({"server": "cost model", **cost.as_dict(),
                          "lookup_token_cost": round(decoder.lookup_policy.token_cost, 4)}), file=sys.stderr)
    capture, follower = None, None
    if args.live is not None:
        from serve_eval.promoted import live_parts

        capture, follower = live_parts(args.live, args.draft if spec.uses_draft else None, args.target, target, chat,
                                       max_model_len, int(args.capture_max_mb * 2**20), args.capture_dtype)
    return Engine(decoder, chat, model_name=args.served_model_name or args.target, max_model_len=max_model_len,
                  default_max_tokens=args.default_max_tokens, adaptive=args.adaptive, cost=cost,
                  prior=draft_prior(meta, args.k), max_queue=args.max_queue, recent_requests=args.recent_requests,
                  traffic=TrafficLog(args.traffic_log, int(args.traffic_log_max_mb * 2**20)) if args.traffic_log
                  else None,
                  shared=SharedLookup(args.lookup_shared_tokens, spec.lookup_min, spec.lookup_max)
                  if args.lookup_shared_tokens else None, capture=capture, follower=follower)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("serve_eval.server", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_eval.server", description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=None, help="draft folder (ours, vLLM, speculators or SGLang format); "
                        "not needed with --proposer lookup")
    add_target_arguments(parser)
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("EAGLE3_API_KEY"))
    add_dataclass_arguments(parser, SpecConfig)
    parser.add_argument("--adaptive", action="store_true", help="choose each round's depth, up to --k (chain mode)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--default-max-tokens", type=int, default=1024)
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--recent-requests", type=int, default=64,
                        help="requests whose own tau and acceptance /metrics shows")
    parser.add_argument("--traffic-log", default=None,
                        help="append each finished chat request (messages, tools, prompt and reply ids, the draft's "
                             "rounds; no headers or keys) to this JSONL file, for mining (off by default)")
    parser.add_argument("--traffic-log-max-mb", type=float, default=256.0, help="the traffic log stops growing here")
    parser.add_argument("--lookup-shared-tokens", type=int, default=0,
                        help="with --proposer lookup or hybrid: also continue from recent replies to other requests, "
                             "at most this many tokens of them held (the oldest dropped; 0: off)")
    parser.add_argument("--live", default=None,
                        help="learn from the traffic: capture each finished request's training sample (its token ids "
                             "and the target states the server computed; no text, headers or keys) into DIR/capture, "
                             "and serve the drafts a live trainer promotes in DIR/serving.json (off by default)")
    parser.add_argument("--capture-max-mb", type=float, default=1024.0,
                        help="with --live: capture pauses while the captured requests hold this much")
    parser.add_argument("--capture-dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn", "float32"),
                        help="with --live: the captured states' dtype (as harvest.dtype)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for flag, value, low in (("--default-max-tokens", args.default_max_tokens, 1), ("--max-queue", args.max_queue, 1),
                             ("--recent-requests", args.recent_requests, 0),
                             ("--lookup-shared-tokens", args.lookup_shared_tokens, 0),
                             ("--threads", args.threads, 1), ("--port", args.port, 0)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    if args.port > 65535:
        parser.error(f"--port must be <= 65535, got {args.port}")
    if args.max_model_len is not None and args.max_model_len < 2:
        parser.error(f"--max-model-len must be >= 2 (or left unset for the target's), got {args.max_model_len}")
    torch.set_num_threads(args.threads)

    import uvicorn

    engine = build_engine(args)
    uvicorn.run(build_app(engine, args.api_key), host=args.host, port=args.port, log_level="info")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
