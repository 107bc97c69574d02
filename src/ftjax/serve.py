"""``python -m ftjax.serve``: an OpenAI-compatible HTTP server on sessions.

  python -m ftjax.serve --model=default-hybrid --host=127.0.0.1 --port=8000

Serves ``POST /v1/chat/completions`` (messages and tools through the model's chat template,
streaming, tool calls, reasoning), ``POST /v1/completions``, ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus). Each request is matched to a cached
session by its longest token prefix, so an agent's next turn reuses the KV cache and the
recurrent-state anchors of the last one. ``--port=0`` lets the OS choose; the first line on
stdout says where it listens, and a later one the reply format replies are parsed in
(``ftjax.server.reply_formats``; ``--reply_format`` overrides the choice). The library behind
it is ``ftjax.server``.
"""

from __future__ import annotations

import os
import sys

import uvicorn
from absl import app, flags, logging

from ftjax import cli_flags
from ftjax.assets import EMBEDDED_MODELS
from ftjax.kernels import KernelsUnavailable
from ftjax.runtime.session import DEFAULT_ANCHOR_BUDGET_BYTES
from ftjax.server.app import DrainingServer, ServerConfig, bind, create_app
from ftjax.server.auth import ENV_ADMIN_KEY, ENV_KEY, ApiKeys, exposure_warning, gather_keys
from ftjax.server.reply_formats import FORMATS


def served_name(model: str | None) -> str:
  """The model id clients use: the embedded model's name or the directory's base name."""
  model = model or "default"
  if model in EMBEDDED_MODELS:
    return model
  return os.path.basename(os.path.normpath(model))


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  cli_flags.check_speculative(_FLAGS["speculative"], "ftjax.serve")
  compiled_in = cli_flags.start_compilation_cache(_ENGINE)
  try:
    engine = cli_flags.build_engine(_ENGINE)
    model = engine.model
    config = ServerConfig(
        model_name=_FLAGS["served_model_name"].value or served_name(_ENGINE["model"].value),
        max_queue=_FLAGS["max_queue"].value, max_body_bytes=_FLAGS["max_body_bytes"].value,
        max_running=_FLAGS["max_running"].value,
        default_max_tokens=_FLAGS["default_max_tokens"].value,
        session_budget_bytes=_FLAGS["session_budget_bytes"].value,
        max_sessions=_FLAGS["max_sessions"].value, session_reuse=_FLAGS["session_reuse"].value,
        anchor_budget_bytes=_FLAGS["anchor_budget_bytes"].value,
        session_dir=_FLAGS["session_dir"].value,
        session_disk_bytes=_FLAGS["session_disk_bytes"].value,
        precompile=_FLAGS["precompile"].value,
        api_keys=gather_keys(_FLAGS["api_key"].value, _FLAGS["api_key_file"].value, ENV_KEY),
        admin_keys=gather_keys(_FLAGS["admin_key"].value, _FLAGS["admin_key_file"].value,
                               ENV_ADMIN_KEY),
        reply_format=_FLAGS["reply_format"].value)
    application = create_app(engine, config)
    sock = bind(_FLAGS["host"].value, _FLAGS["port"].value)
  except (ValueError, FileNotFoundError, KernelsUnavailable, OSError) as e:
    raise SystemExit(f"ftjax.serve: error: {e}") from None
  host, port = sock.getsockname()[:2]
  shown = f"[{host}]" if ":" in host else host
  print(f"ftjax.serve: {config.model_name} ({model.config.model_type}, kernels "
        f"{engine.kernels_path}) on http://{shown}:{port}/v1", flush=True)
  print(f"ftjax.serve: compilation cache: {compiled_in}", flush=True)
  served = application.state.server
  why = served.selection.reason or "unknown: reasoning and tool calls are not split out"
  print(f"ftjax.serve: reply format {served.reply_format.name} ({why}; tool calls sent back "
        f"render with their arguments as {served.template.tool_arguments})", flush=True)
  keys = ApiKeys(config.api_keys, config.admin_keys)
  print(f"ftjax.serve: API keys: {len(config.api_keys) or 'none'}"
        + (f", admin keys: {len(config.admin_keys)}" if config.admin_keys else ""), flush=True)
  warning = exposure_warning(host, port, keys)
  if warning:
    print(warning, file=sys.stderr, flush=True)
  if config.precompile:
    print("ftjax.serve: preparing the programs a request can run before serving (loaded from "
          "the executable store, or compiled); GET /health answers 503 until they are done",
          flush=True)
  # SIGTERM / SIGINT: no new request (503), the running ones finish within --shutdown_grace
  # seconds, then exit 0 (DrainingServer); a second signal exits at once.
  server = DrainingServer(uvicorn.Config(application, log_level=_FLAGS["log_level"].value,
                                         timeout_graceful_shutdown=5), application,
                          grace_s=_FLAGS["shutdown_grace"].value)
  try:
    server.run(sockets=[sock])
  finally:
    application.state.server.worker.stop()
  sys.stdout.flush()


def cli() -> None:
  """Defines the flags and runs ``main`` (``python -m ftjax.serve``)."""
  global _ENGINE, _FLAGS
  _ENGINE = cli_flags.define_engine_flags()
  d = ServerConfig()
  _FLAGS = {
      "host": flags.DEFINE_string("host", "127.0.0.1", "address to listen on"),
      "precompile": cli_flags.define_precompile_flag(True),
      "speculative": cli_flags.define_unsupported_speculative_flag("ftjax.serve"),
      "port": flags.DEFINE_integer("port", 8000, "TCP port (0: the OS chooses)", lower_bound=0,
                                   upper_bound=65535),
      "served_model_name": flags.DEFINE_string(
          "served_model_name", None, "the model id clients send (default: the embedded "
          "model's name or the model directory's base name)"),
      "shutdown_grace": flags.DEFINE_float(
          "shutdown_grace", 30.0, "on SIGTERM or SIGINT: seconds the running and waiting "
          "requests may take to finish while new ones get 503 with Retry-After; then the "
          "server exits 0 (a second signal: at once)", lower_bound=0.0),
      "max_queue": flags.DEFINE_integer(
          "max_queue", d.max_queue, "requests that may wait behind the running ones; more "
          "get 429 with Retry-After", lower_bound=1),
      "max_running": flags.DEFINE_integer(
          "max_running", d.max_running, "requests that decode together in one batch "
          "(continuous batching; 1: one at a time)", lower_bound=1),
      "max_body_bytes": flags.DEFINE_integer("max_body_bytes", d.max_body_bytes,
                                             "largest request body (more: 413)", lower_bound=1),
      "default_max_tokens": flags.DEFINE_integer(
          "default_max_tokens", d.default_max_tokens, "completion limit of a chat request "
          "that sets none", lower_bound=1),
      "session_budget_bytes": flags.DEFINE_integer(
          "session_budget_bytes", d.session_budget_bytes, "memory of the cached sessions (KV, "
          "recurrent states, anchors); least recently used ones go first", lower_bound=0),
      "max_sessions": flags.DEFINE_integer("max_sessions", d.max_sessions,
                                           "cached sessions at most", lower_bound=1),
      "session_reuse": flags.DEFINE_boolean(
          "session_reuse", True, "match requests to cached sessions (false: every request "
          "prefills its whole prompt)"),
      "anchor_budget_bytes": flags.DEFINE_integer(
          "anchor_budget_bytes", DEFAULT_ANCHOR_BUDGET_BYTES,
          "host memory for recurrent-state anchors per session (0: none)", lower_bound=0),
      "session_dir": flags.DEFINE_string(
          "session_dir", None, "keep sessions on disk here across restarts: those dropped from "
          "memory and, at shutdown, those held are saved (KV, recurrent states, anchors); a "
          "request whose prompt a saved session serves loads it instead of prefilling"),
      "session_disk_bytes": flags.DEFINE_integer(
          "session_disk_bytes", d.session_disk_bytes, "disk the saved sessions may take "
          "(--session_dir); the least recently saved are deleted first", lower_bound=0),
      "api_key": flags.DEFINE_string(
          "api_key", None, f"the key every route but /health needs (Authorization: Bearer, "
          f"or x-api-key); default ${ENV_KEY}, which keeps it out of the process list"),
      "api_key_file": flags.DEFINE_string(
          "api_key_file", None, "a file of keys, one a line (# comments), each accepted"),
      "admin_key": flags.DEFINE_string(
          "admin_key", None, f"the key POST /v1/cache needs (it resizes the expert cache for "
          f"everyone); default ${ENV_ADMIN_KEY}"),
      "admin_key_file": flags.DEFINE_string("admin_key_file", None,
                                            "a file of admin keys, one a line"),
      "reply_format": flags.DEFINE_enum(
          "reply_format", None, list(FORMATS), "how the model writes reasoning and tool calls "
          "(default: chosen by the chat template's tags, else the config's model_type; "
          "docs/serve.md)"),
      "log_level": flags.DEFINE_enum("log_level", "warning",
                                     ["critical", "error", "warning", "info", "debug"],
                                     "uvicorn's log level (info: one line per request)"),
  }
  app.run(main)


if __name__ == "__main__":
  cli()
