"""The OpenAI-compatible HTTP server: a FastAPI app over one engine and its session pool.

Requests are validated and mapped to jobs (``openai``, ``anthropic``, ``responses``: the API
mappings, over ``protocol``), rendered with the model's chat template and tokenized on the
event loop, then queued as jobs for the scheduler (``scheduler.Worker``), whose one thread runs
the engine's decode loop with up to ``max_running`` requests in one batch. This module holds
the routes and the errors, and turns a job's events into a response, whole or streamed as
server-sent events, in the shape its API's mapping makes (``Server.respond``).

``create_app(engine, ServerConfig(...))`` makes the app; ``BackgroundServer`` runs it with
uvicorn in a thread (tests, notebooks); ``python -m ftjax.serve`` is the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import socket
import sys
import threading
import time
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ftjax.runtime.chat_template import ChatTemplateError, load_chat_template
from ftjax.runtime.engine import Engine
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.server import anthropic, openai, responses
from ftjax.server.auth import ApiKeys, RequireKey
from ftjax.server.metrics import Metrics
from ftjax.server.outputs import Delta
from ftjax.server.protocol import (ApiError, CacheRequest, ChatRequest, ChatSpec,
                                   CompletionRequest)
from ftjax.server.reply_formats import fit_template, select_format
from ftjax.server.scheduler import Job, Outcome, ServerConfig, Worker


_LOG = logging.getLogger("uvicorn.error")  # where uvicorn's own messages go


class TurnEncoder:
  """Token ids of rendered prompts, encoded one turn at a time with the turns' ids cached.

  An agent resends its whole conversation each turn, so all but the newest turns were encoded
  before. The text is cut before each ``<|im_start|>``; a tokenizer isolates its added tokens
  before the BPE runs, so the pieces encode independently, and their ids joined equal the
  whole text's. That is checked once on a probe text (a tokenizer whose post-processor adds
  tokens, a BOS say, would fail it): then every prompt is encoded whole (``per_turn`` False)."""

  def __init__(self, tokenizer, marker: str = "<|im_start|>", max_entries: int = 4096):
    self.tokenizer, self.marker, self.max_entries = tokenizer, marker, max_entries
    self._cache: dict[str, list[int]] = {}
    probe = ["system\nhi there", f"{marker}user\n x = [1, 2]\n", f"{marker}assistant\n"]
    self.per_turn = (tokenizer.token_id(marker) is not None and tokenizer.encode("".join(probe))
                     == [t for piece in probe for t in tokenizer.encode(piece)])

  def encode(self, text: str) -> list[int]:
    if not self.per_turn:
      return self.tokenizer.encode(text)
    ids: list[int] = []
    start = 0
    while start < len(text):
      end = text.find(self.marker, start + 1)
      end = len(text) if end < 0 else end
      piece = text[start:end]
      cached = self._cache.get(piece)
      if cached is None:
        cached = self.tokenizer.encode(piece)
        if len(self._cache) >= self.max_entries:
          self._cache.pop(next(iter(self._cache)))  # the oldest entry
        self._cache[piece] = cached
      ids += cached
      start = end
    return ids


class Server:
  """The app's state: the engine's worker, the template and tokenizer, the reply format
  (``reply_formats``: chosen here, with a warning in the log when it is unknown, and the
  template fitted to render the format's tool calls back), the metrics."""

  def __init__(self, engine: Engine, config: ServerConfig):
    self.engine, self.config = engine, config
    model = engine.model
    self.tokenizer = load_tokenizer(model.path, model.config.vocab_size)
    self.encoder = TurnEncoder(self.tokenizer)
    self.template = load_chat_template(model.path)
    self.selection = select_format(model.config.model_type, self.template.text,
                                   config.reply_format)
    self.reply_format = self.selection.format
    for warning in (self.selection.warning(model.config.model_type, self.template.source),
                    fit_template(self.template, self.reply_format)):
      if warning:
        _LOG.warning("%s", warning)
    self.metrics = Metrics()
    self.worker = Worker(engine, config)
    self.metrics.bind(self.worker, engine)
    self.created = int(time.time())
    engine.compile_listener = self._compiled

  def cache_info(self) -> dict[str, Any]:
    """``GET /v1/cache`` (run on the engine thread): the expert cache and the device budget
    (``Engine.cache_info``), the jobs running and waiting, and the last finished sequences'
    decode statistics (``Generation.stats``: the steps each decoded, the rows beside it, and
    the cache's hits, fills and host-run experts of those steps)."""
    w = self.worker
    return {"object": "cache", **self.engine.cache_info(), "running": w.running,
            "waiting": w.waiting, "max_running": w.max_running, "sequences": list(w.recent)}

  @property
  def fingerprint(self) -> str:
    """The ``system_fingerprint`` of OpenAI's replies: the kernels the engine runs."""
    return f"ftjax-{self.engine.kernels}"

  def _compiled(self, key: tuple, seconds: float) -> None:
    if not self.worker.startup["done"]:  # start-up compiles are logged as progress
      return
    table = self.engine.executor.table
    if table is not None and key in table.loaded:  # a warm start's later programs
      _LOG.info("ftjax.serve: loaded the %s program for %s from the executable store in "
                "%.2f s", key[0], key[1:], seconds)
    else:
      _warn_compile(key, seconds)


  # -- Requests to jobs ---------------------------------------------------------------------

  def check_model(self, name: str) -> None:
    if name != self.config.model_name:
      raise ApiError(404, f"the model {name!r} does not exist: this server serves "
                     f"{self.config.model_name!r} (GET /v1/models)", param="model",
                     code="model_not_found")

  def _limit(self, prompt_len: int, requested: int | None, prompt_param: str) -> int:
    """The completion limit: as requested (or the server's default), clipped to the room the
    prompt leaves in the context (the reply then ends with ``length``, as llama-server does).
    Only a prompt that does not fit on its own is refused (one that fills it exactly is
    served when nothing is to be generated: a prompt scored with ``max_tokens`` 0)."""
    window = self.engine.max_seq_len
    left = window - prompt_len
    if left < 1 and not (left == 0 and requested == 0):
      raise ApiError(400, f"the prompt is {prompt_len} tokens, which leaves no room in this "
                     f"model's context of {window} tokens: shorten it, or serve a longer "
                     "context (--max_seq_len)", param=prompt_param,
                     code="context_length_exceeded")
    return min(self.config.default_max_tokens if requested is None else requested, left)

  def _sampling(self, req) -> dict[str, Any]:
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    # Any integer seed (OpenAI's are unbounded): the engine's are uint32.
    seed = req.seed % 2**32 if req.seed is not None else random.getrandbits(32)
    if temperature == 0:
      return {"greedy": True, "seed": seed}
    out = {"greedy": False, "temperature": temperature, "top_p": top_p, "seed": seed}
    if getattr(req, "top_k", None):
      out["top_k"] = req.top_k
    return out

  def render(self, spec: ChatSpec, prompt_param: str = "messages") -> str:
    """The prompt text of ``spec`` by the model's chat template (a 400 naming the problem)."""
    try:
      return self.template.render(spec.messages, tools=spec.tools, add_generation_prompt=True,
                                  **spec.template_options)
    except ChatTemplateError as e:
      raise ApiError(400, f"the messages cannot be rendered with the model's chat template: {e}",
                     param=prompt_param) from None
    except TypeError as e:
      raise ApiError(400, f"{sorted(spec.template_options)} are not valid template options: "
                     f"{e}", param="chat_template_kwargs") from None

  def spec_job(self, spec: ChatSpec, loop, received: float,
               prompt_param: str = "messages") -> Job:
    """The job of a chat request of any API (``spec.logprobs``: its tokens' log-probs with
    that many alternatives)."""
    self.check_model(spec.model)
    prompt = self.render(spec, prompt_param)
    ids = self.encoder.encode(prompt)
    limit = self._limit(len(ids), spec.max_tokens, prompt_param)
    return Job(ids=ids, max_tokens=limit, sampling=self._sampling(spec), stops=spec.stops,
               stream=spec.stream, chat=True,
               reasoning=self.reply_format.opens_thinking(prompt),
               tool_calls=spec.parse_tool_calls, loop=loop, received=received,
               reply_format=self.reply_format, tools=spec.tools, logprobs=spec.logprobs)

  def count_tokens(self, spec: ChatSpec, prompt_param: str = "messages") -> int:
    """The prompt tokens ``spec`` would be given (the generation prompt included)."""
    self.check_model(spec.model)
    return len(self.encoder.encode(self.render(spec, prompt_param)))

  def completion_jobs(self, req: CompletionRequest, loop, received: float) -> list[Job]:
    """The jobs of a completions request, one per prompt: its ids, continued as they are
    (``echo``: the reply repeats the prompt, with its log-probs when ``logprobs`` is set)."""
    self.check_model(req.model)
    jobs = []
    prompts = req.prompts
    for i, prompt in enumerate(prompts):
      param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
      ids = openai.prompt_ids(prompt, self.tokenizer, self.engine.model.config.vocab_size,
                              param)
      limit = self._limit(len(ids), req.limit, param)
      echo_text = "" if not req.echo else (
          prompt if isinstance(prompt, str) else self.tokenizer.decode(ids))
      jobs.append(Job(ids=ids, max_tokens=limit, sampling=self._sampling(req),
                      stops=req.stops, stream=req.stream, chat=False, reasoning=False,
                      tool_calls=False, loop=loop, received=received, logprobs=req.logprobs,
                      echo=req.echo, echo_text=echo_text))
    return jobs

  # -- Jobs to responses --------------------------------------------------------------------

  async def events(self, job: Job, heartbeat_s: float | None = None
                   ) -> AsyncIterator[tuple[str, Any]]:
    """The job's events as the worker sends them, to ``done``, ``error`` or ``cancelled``;
    with ``heartbeat_s``, a ``("ping", None)`` after each that long without one (a stream
    waiting in the queue or in a long prefill stays visibly alive)."""
    while True:
      if heartbeat_s is None:
        kind, payload = await job.events.get()
      else:
        try:
          kind, payload = await asyncio.wait_for(job.events.get(), heartbeat_s)
        except asyncio.TimeoutError:
          yield "ping", None
          continue
      yield kind, payload
      if kind in ("done", "error", "cancelled"):
        return

  async def respond(self, job: Job, request: Request, endpoint: str,
                    stream: Callable[[AsyncIterator[tuple[str, Any]], Callable[[Outcome], None]],
                                     AsyncIterator[str]],
                    body: Callable[[list[Delta], Outcome], dict[str, Any]],
                    heartbeat_s: float | None = None) -> Response:
    """The response to ``job``'s request, in its API's shapes: streamed (``job.stream``), the
    server-sent events ``stream(events, on_done)`` makes of the job's ``events`` (with
    ``heartbeat_s``: pings); else the JSON ``body(deltas, outcome)`` of the whole reply, or
    ``{}`` when the client went away. ``on_done(outcome)`` counts a finished reply under
    ``endpoint``. The job is submitted here; a client that goes away cancels it
    (``cancel_on_disconnect``)."""

    def on_done(outcome: Outcome) -> None:
      self.metrics.finished(endpoint, outcome)

    self.worker.submit(job)  # a 429 is raised here, before a stream starts
    if job.stream:
      async def watched() -> AsyncIterator[str]:
        async with cancel_on_disconnect(request, job):
          async for chunk in stream(self.events(job, heartbeat_s), on_done):
            yield chunk

      return StreamingResponse(watched(), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    deltas, outcome = await self.collect(job, request)
    if outcome is None:  # cancelled: the client is gone
      return JSONResponse({})
    on_done(outcome)
    return JSONResponse(body(deltas, outcome))

  async def respond_all(self, jobs: list[Job], request: Request, endpoint: str
                        ) -> list[tuple[list[Delta], Outcome]]:
    """The whole replies of ``jobs`` (one request's prompts), submitted together so that
    they run side by side: each one's deltas and outcome. One refused (429) or failed fails
    the request, and the others are cancelled."""
    try:
      for job in jobs:
        self.worker.submit(job)
      results = await asyncio.gather(*(self.collect(job, request) for job in jobs))
    finally:
      for job in jobs:
        job.cancelled.set()  # a no-op for those done; drops the rest after a failure
    if any(outcome is None for _, outcome in results):
      return []  # the client went away
    for _, outcome in results:
      self.metrics.finished(endpoint, outcome)
    return list(results)

  async def collect(self, job: Job, request: Request) -> tuple[list[Delta], Outcome | None]:
    """Waits for the submitted ``job``'s end: its deltas and outcome (None when the client
    went away, which cancels the job). Raises the worker's exception if generation failed."""
    deltas: list[Delta] = []
    outcome = None
    async with cancel_on_disconnect(request, job):
      async for kind, payload in self.events(job):
        if kind == "deltas":
          deltas += payload
        elif kind == "error":
          raise payload
        elif kind == "done":
          outcome = payload
    return deltas, outcome


def _warn_compile(key: tuple, seconds: float) -> None:
  """A compile while serving: a request waited for it (a shape not seen before)."""
  _LOG.warning("ftjax.serve: compiled the %s program for %s in %.2f s while serving (a new "
               "shape; counted in ftjax_compiles_total)", key[0], key[1:], seconds)


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request, job: Job) -> AsyncIterator[None]:
  """The one watch of a reply's client: inside it, ``job`` is cancelled as soon as the client
  goes away; on leaving, it is cancelled anyway (a no-op when it is done; it drops a job whose
  reply was abandoned). The request's body has been read, so the next ASGI message is the
  disconnect (uvicorn answers every later receive with it too): no polling."""

  async def watch() -> None:
    while True:
      message = await request.receive()
      if message["type"] == "http.disconnect":
        job.cancelled.set()
        return

  watcher = asyncio.create_task(watch())
  try:
    yield
  finally:
    watcher.cancel()
    job.cancelled.set()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
  errors = exc.errors()
  if not errors:
    return "the request body is not valid", None
  first = errors[0]
  if first.get("type") == "json_invalid":
    return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
  loc = [str(x) for x in first.get("loc", ()) if x != "body"]
  param = ".".join(loc) or None
  message = first.get("msg", "invalid value").removeprefix("Value error, ")
  if first.get("type") == "missing":
    message = f"'{param}' is required"
  elif param:
    message = f"{param}: {message}"
  more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
  return message + more, param


class BodyLimit:
  """ASGI middleware: a request body over ``limit`` bytes is answered 413 (unread when its
  Content-Length says so, else as soon as the bytes read pass the limit)."""

  def __init__(self, app, limit: int):
    self.app, self.limit = app, limit

  def message(self) -> str:
    return f"the request body is over the server's limit of {self.limit} bytes (--max_body_bytes)"

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    declared = dict(scope.get("headers", ())).get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > self.limit:
      error = ApiError(413, self.message(), code="request_too_large")
      return await JSONResponse(error.body(), status_code=413)(scope, receive, send)
    seen = 0

    async def counted():
      nonlocal seen
      message = await receive()
      if message["type"] == "http.request":
        seen += len(message.get("body", b""))
        if seen > self.limit:  # answered by the app's handler of HTTP errors
          raise StarletteHTTPException(413, self.message())
      return message

    await self.app(scope, counted, send)


def create_app(engine: Engine, config: ServerConfig = ServerConfig()) -> FastAPI:
  """The FastAPI app serving ``engine``'s model under ``config.model_name``."""
  server = Server(engine, config)
  app = FastAPI(title="ftjax", version="1", docs_url=None, redoc_url=None, openapi_url=None)
  app.state.server = server

  @app.exception_handler(ApiError)
  async def api_error(request: Request, exc: ApiError):
    server.metrics.rejected(request.url.path, exc.status)
    body = (anthropic.error_body(exc) if request.url.path.startswith("/v1/messages")
            else exc.body())  # each API's errors in its own shape
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)

  @app.exception_handler(RequestValidationError)
  async def invalid(request: Request, exc: RequestValidationError):
    message, param = _validation_message(exc)
    return await api_error(request, ApiError(400, message, param=param))

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 404:
      message = (f"no route {request.method} {request.url.path}: this server serves "
                 "POST /v1/chat/completions, POST /v1/completions, POST /v1/messages, "
                 "POST /v1/messages/count_tokens, POST /v1/responses, GET /v1/models, "
                 "GET /health and GET /metrics")
    elif exc.status_code == 405:
      message = f"{request.method} is not allowed on {request.url.path}"
    else:
      message = str(exc.detail)
    return await api_error(request, ApiError(
        exc.status_code, message, code={413: "request_too_large"}.get(exc.status_code),
        headers=dict(exc.headers or {})))

  @app.exception_handler(Exception)
  async def unexpected(request: Request, exc: Exception):
    return await api_error(request, ApiError(500, f"internal error: {type(exc).__name__}: "
                                             f"{exc}"))

  @app.api_route("/", methods=["GET", "HEAD"])
  async def root():  # clients probe it (Claude Code sends HEAD /)
    return {"status": "ok", "model": config.model_name}

  @app.get("/health")
  async def health():
    w = server.worker
    startup = dict(w.startup)
    status = "shutting down" if w.draining else "ok" if startup["done"] else "starting"
    body = {"status": status, "model": config.model_name,
            "waiting": w.waiting, "running": w.running, "startup": startup}
    # 503 until start-up compilation is done (as llama-server while it loads): requests sent
    # before then wait for it; 503 again once a graceful shutdown began (``DrainingServer``).
    return JSONResponse(body, status_code=200 if status == "ok" else 503)

  @app.get("/v1/cache")
  async def cache_info():
    return await asyncio.wrap_future(server.worker.control(server.cache_info))

  @app.post("/v1/cache")
  async def cache_resize(req: CacheRequest):
    def resize() -> dict[str, Any]:
      engine = server.engine
      if engine.cache is None:
        raise ApiError(400, "this server has no expert cache to resize: start it with a cache "
                       "size (--device_budget_bytes, --cache_slots, --cache_fraction or "
                       "--cache_bytes)", code="no_cache")
      if req.budget_bytes is not None:
        engine.set_budget(req.budget_bytes)
      else:
        engine.memory.total = None  # a fixed size from now on
        engine.resize_cache(slots=req.slots, reason="POST /v1/cache")
      return server.cache_info()
    return await asyncio.wrap_future(server.worker.control(resize))

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [_model_card(server)]}

  @app.get("/v1/models/{name:path}")
  async def model(name: str):
    server.check_model(name)
    return _model_card(server)

  @app.get("/metrics")
  async def metrics():
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

  async def openai_response(job: Job, request: Request, endpoint: str, include_usage: bool):
    rid, model, fingerprint = openai.completion_id(job.chat), config.model_name, server.fingerprint
    return await server.respond(
        job, request, endpoint,
        lambda events, on_done: openai.stream(events, rid, model, fingerprint, job.chat,
                                              include_usage, on_done),
        lambda deltas, outcome: openai.completion_body(rid, model, fingerprint, job.chat,
                                                       deltas, outcome,
                                                       job.logprobs is not None))

  @app.post("/v1/chat/completions")
  async def chat(req: ChatRequest, request: Request):
    received = time.perf_counter()
    job = server.spec_job(openai.to_spec(req), asyncio.get_running_loop(), received)
    return await openai_response(job, request, "chat", openai.include_usage(req))

  @app.post("/v1/completions")
  async def completions(req: CompletionRequest, request: Request):
    received = time.perf_counter()
    jobs = server.completion_jobs(req, asyncio.get_running_loop(), received)
    if len(jobs) == 1:
      return await openai_response(jobs[0], request, "completions", openai.include_usage(req))
    return JSONResponse(openai.completions_body(
        openai.completion_id(False), config.model_name, server.fingerprint,
        await server.respond_all(jobs, request, "completions"), req.logprobs is not None))

  @app.post("/v1/messages")
  async def messages(req: anthropic.MessagesRequest, request: Request):
    received = time.perf_counter()
    job = server.spec_job(anthropic.to_spec(req), asyncio.get_running_loop(), received)
    rid, model = anthropic.message_id(), config.model_name
    return await server.respond(
        job, request, "messages",
        lambda events, on_done: anthropic.stream(events, rid, model, len(job.ids), on_done),
        lambda deltas, outcome: anthropic.message_body(rid, model, deltas, outcome),
        heartbeat_s=PING_S)

  @app.post("/v1/messages/count_tokens")
  async def count_tokens(req: anthropic.CountTokensRequest):
    return {"input_tokens": server.count_tokens(anthropic.to_spec(req))}

  @app.post("/v1/responses")
  async def create_response(req: responses.Request, request: Request):
    received = time.perf_counter()
    job = server.spec_job(responses.to_spec(req), asyncio.get_running_loop(), received,
                          prompt_param="input")
    rid, model = responses.response_id(), config.model_name
    return await server.respond(
        job, request, "responses",
        lambda events, on_done: responses.stream(events, rid, req, model, on_done),
        lambda deltas, outcome: responses.response_body(rid, req, model, deltas, outcome))

  app.add_middleware(BodyLimit, limit=config.max_body_bytes)
  # Added last, so it runs first: a request without a valid key is refused unread.
  keys = ApiKeys(config.api_keys, config.admin_keys)
  if keys.required or keys.admin_required:
    app.add_middleware(RequireKey, keys=keys, rejected=server.metrics.rejected)
  return app


PING_S = 5.0  # a streamed Anthropic reply sends a ping after this long without an event


def _model_card(server: Server) -> dict[str, Any]:
  c = server.engine.model.config
  return {"id": server.config.model_name, "object": "model", "created": server.created,
          "owned_by": "ftjax", "model_type": c.model_type, "max_model_len": server.engine.max_seq_len}


class BackgroundServer:
  """Runs ``app`` with uvicorn in a daemon thread on ``host`` and an OS-chosen port (or
  ``port``); ``url`` is its base URL, ``stop()`` shuts it down."""

  def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
    self.app = app
    self.socket = bind(host, port)
    self.host, self.port = self.socket.getsockname()[:2]
    self.url = f"http://{self.host}:{self.port}"
    self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                   daemon=True, name="ftjax-http")
    self.thread.start()
    deadline = time.monotonic() + 30
    while not self.server.started:
      if time.monotonic() > deadline or not self.thread.is_alive():
        raise RuntimeError("the HTTP server did not start")
      time.sleep(0.01)

  def stop(self) -> None:
    self.server.should_exit = True
    self.thread.join(timeout=30)
    self.app.state.server.worker.stop()
    self.socket.close()


class DrainingServer(uvicorn.Server):
  """uvicorn's server with a graceful shutdown: the first SIGTERM or SIGINT stops admitting
  requests (new ones get 503 with ``Retry-After`` in their API's shape, ``/health`` 503
  "shutting down") and lets the admitted and waiting ones finish, up to ``grace_s`` seconds.
  Those still running when the grace ends, or at a second signal, are cancelled (each reply
  ends as if its client had gone, at its next decode chunk). Once the replies are written,
  uvicorn closes the connections and ``run`` returns: the process exits 0 (uvicorn's own
  handler would re-raise the signal). Progress goes to ``log`` (stderr by default)."""

  FLUSH_S = 10.0  # the most a cancelled job or a reply's last bytes are waited for

  def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float, log=None):
    super().__init__(config)
    self.app, self.grace_s = app, grace_s
    self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    self._drainer: threading.Thread | None = None
    self._now = threading.Event()  # a second signal: cancel what runs

  def handle_exit(self, sig: int, frame) -> None:
    if self._drainer is not None:
      self._now.set()
      return
    self._drainer = threading.Thread(target=self._drain, args=(signal.Signals(sig).name,),
                                     name="ftjax-drain", daemon=True)
    self._drainer.start()

  def _wait(self, done: Callable[[], bool], seconds: float, *,
            interruptible: bool = False) -> bool:
    """Polls ``done`` for up to ``seconds`` (``interruptible``: or until a second signal)."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline and not (
        interruptible and self._now.is_set()):
      time.sleep(0.05)
    return done()

  def _drain(self, name: str) -> None:
    worker = self.app.state.server.worker
    worker.drain(self.grace_s)
    begun = time.monotonic()
    self.log(f"ftjax.serve: {name}: shutting down; {worker.running} running and "
             f"{worker.waiting} waiting requests may finish within {self.grace_s:g} s, new "
             "ones get 503")
    if self._wait(worker.idle, self.grace_s, interruptible=True):
      self.log(f"ftjax.serve: every request finished in {time.monotonic() - begun:.1f} s; "
               "exiting")
    else:
      why = "a second signal" if self._now.is_set() else f"the {self.grace_s:g} s grace ended"
      cancelled = worker.cancel_all()
      self.log(f"ftjax.serve: {why}: {cancelled} requests cancelled; exiting")
      self._wait(worker.idle, self.FLUSH_S)
    # The replies' last bytes (a stream's closing events) may still be being written.
    self._wait(lambda: not self.server_state.tasks, self.FLUSH_S)
    self.should_exit = True


def bind(host: str, port: int) -> socket.socket:
  """A listening TCP socket on ``host``:``port`` (0: the OS picks). Made with an explicit
  IPPROTO_TCP, so that asyncio sets TCP_NODELAY on the connections it accepts (it checks the
  protocol number): without it a response's head and body, written apart, wait on Nagle's
  algorithm and the client's delayed ACK, 40 ms a request."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  sock.listen(128)
  return sock


