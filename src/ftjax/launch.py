"""``python -m ftjax.launch CLIENT [FLAGS] [-- CLIENT_ARGS]``: a coding agent on a local server.

  python -m ftjax.launch claude --model=default-hybrid -- -p "Fix the failing test"
  python -m ftjax.launch codex -- exec "Add a --verbose flag"
  python -m ftjax.launch opencode --url=http://127.0.0.1:8000 -- run "Explain main.py"

Starts ``python -m ftjax.serve`` with the flags given (every flag but the launcher's own goes
to the server; ``--port=0`` unless one is given), waits until it is ready, writes the client's
configuration into a temporary home, runs the client there with ``CLIENT_ARGS``, and stops the
server when the client exits. With ``--url`` it uses a server already listening instead. The
user's own configuration files are never read or written:

* ``claude`` (Claude Code, the Anthropic Messages API): environment variables only
  (``ANTHROPIC_BASE_URL``, ``ANTHROPIC_AUTH_TOKEN``, every model alias set to the served model)
  and ``CLAUDE_CONFIG_DIR`` in the temporary home;
* ``codex`` (Codex CLI, the Responses API): ``CODEX_HOME`` in the temporary home, with a
  ``config.toml`` whose model provider has ``wire_api = "responses"`` and reads its key from
  ``FTJAX_API_KEY``;
* ``opencode`` (OpenCode, chat completions): ``OPENCODE_CONFIG`` naming an ``opencode.json`` in
  the temporary home, with an OpenAI-compatible provider (its key ``{env:FTJAX_API_KEY}``) and
  the model's context as its limit.

The key the client sends is the server's API key (``--api_key``, default ``$FTJAX_API_KEY``;
or the first key of a ``--api_key_file`` given to the started server), or a placeholder when
the server has none. A server the launcher starts gets ``--api_key`` through its environment,
never on its command line; the key is never written into the temporary home.

The exit status is the client's (2 when it is not installed: the error says how to install it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from ftjax.server.auth import ENV_KEY, read_key_file


@dataclasses.dataclass(frozen=True)
class Client:
  binary: str
  package: str  # on npm
  api: str  # what it speaks


CLIENTS = {
    "claude": Client("claude", "@anthropic-ai/claude-code", "Anthropic Messages"),
    "codex": Client("codex", "@openai/codex", "OpenAI Responses"),
    "opencode": Client("opencode", "opencode-ai", "OpenAI chat completions"),
}
# What clients send when the server has no API key (they insist on having one).
PLACEHOLDER_KEY = "ftjax-local"


class LaunchError(Exception):
  pass


def client_env(name: str, url: str, model: str, context: int, home: str,
               api_key: str | None = None) -> dict[str, str]:
  """The environment variables that point client ``name`` at the server at ``url`` (no
  ``/v1``), serving ``model`` with a ``context``-token window, sending ``api_key`` (the
  server's key, or a placeholder when it has none); configuration files go under ``home``,
  which must exist. The key itself goes into the environment only, never a file."""
  key = api_key or PLACEHOLDER_KEY
  if name == "claude":
    env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": key,
           "ANTHROPIC_MODEL": model,
           "ANTHROPIC_SMALL_FAST_MODEL": model, "CLAUDE_CODE_SUBAGENT_MODEL": model,
           "CLAUDE_CONFIG_DIR": os.path.join(home, "claude"),
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    for alias in ("OPUS", "SONNET", "HAIKU"):
      env[f"ANTHROPIC_DEFAULT_{alias}_MODEL"] = model
    os.makedirs(env["CLAUDE_CONFIG_DIR"], exist_ok=True)
    return env
  if name == "codex":
    codex_home = os.path.join(home, "codex")
    os.makedirs(codex_home, exist_ok=True)
    with open(os.path.join(codex_home, "config.toml"), "w") as f:
      f.write(f"model = {json.dumps(model)}\n"
              'model_provider = "ftjax"\n'
              f"model_context_window = {int(context)}\n"
              "\n[model_providers.ftjax]\n"
              'name = "ftjax"\n'
              f"base_url = {json.dumps(url + '/v1')}\n"
              'wire_api = "responses"\n'
              f'env_key = "{ENV_KEY}"\n')
    return {"CODEX_HOME": codex_home, ENV_KEY: key}
  if name == "opencode":
    path = os.path.join(home, "opencode.json")
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"ftjax": {
            "npm": "@ai-sdk/openai-compatible", "name": "ftjax",
            "options": {"baseURL": url + "/v1", "apiKey": "{env:" + ENV_KEY + "}"},
            "models": {model: {"name": model, "limit": {"context": int(context),
                                                        "output": int(context) // 2}}}}},
        "model": f"ftjax/{model}"}
    with open(path, "w") as f:
      json.dump(config, f, indent=2)
    return {"OPENCODE_CONFIG": path, ENV_KEY: key}
  raise LaunchError(f"unknown client {name!r}: choose one of {', '.join(CLIENTS)}")


def _get_json(url: str, timeout: float = 10.0, api_key: str | None = None) -> dict:
  headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                              timeout=timeout) as r:
    return json.loads(r.read())


def served_model(url: str, api_key: str | None = None) -> tuple[str, int]:
  """The served model's id and context length, from ``GET /v1/models``."""
  try:
    card = _get_json(url + "/v1/models", api_key=api_key)["data"][0]
  except urllib.error.HTTPError as e:
    if e.code in (401, 403):
      raise LaunchError(f"the server at {url} needs an API key: give the launcher --api_key "
                        f"or set {ENV_KEY}") from None
    raise LaunchError(f"GET {url}/v1/models answered {e.code}") from None
  except (OSError, ValueError, KeyError, IndexError) as e:
    raise LaunchError(f"no ftjax server answers at {url} ({e}): start one with python -m "
                      "ftjax.serve, or leave out --url to let the launcher start it") from None
  return card["id"], int(card.get("max_model_len") or 0)


class Server:
  """``python -m ftjax.serve`` in a child process, its log in ``log_path``."""

  def __init__(self, flags: list[str], log_path: str, timeout_s: float = 600.0,
               api_key: str | None = None):
    if not any(f == "--port" or f.startswith("--port=") for f in flags):
      flags = ["--port=0", *flags]
    self.log_path = log_path
    self._log = open(log_path, "w")
    command = [sys.executable, "-m", "ftjax.serve", *flags]
    print(f"ftjax.launch: starting {' '.join(command[1:])} (log: {log_path})", flush=True)
    t0 = time.monotonic()
    # The key through the environment, out of the process list.
    env = {**os.environ, **({ENV_KEY: api_key} if api_key else {})}
    self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                 env=env)
    first = self.proc.stdout.readline()  # after the model is loaded and the socket bound
    found = re.search(r" on (http://\S+?)/v1\s*$", first)
    if not found:
      self.stop()
      raise LaunchError(f"ftjax.serve did not start: {first.strip() or 'no output'}; "
                        f"{self.tail()}")
    self.url = found.group(1)
    # The rest of its stdout (uvicorn's access lines at --log_level=info) goes to the log too.
    threading.Thread(target=self._copy_stdout, daemon=True).start()
    shown = None
    while True:
      try:
        if _get_json(self.url + "/health", timeout=2).get("status") == "ok":
          break
      except urllib.error.HTTPError as e:  # 503 while it compiles its programs at start-up
        try:
          startup = json.loads(e.read()).get("startup") or {}
        except ValueError:
          startup = {}
        if startup.get("programs") and startup.get("compiled") != shown:
          shown = startup["compiled"]
          print(f"ftjax.launch: the server is compiling its programs: {shown}/"
                f"{startup['programs']}", flush=True)
      except (OSError, ValueError):
        pass
      if self.proc.poll() is not None or time.monotonic() - t0 > timeout_s:
        self.stop()
        raise LaunchError(f"ftjax.serve did not become ready; {self.tail()}")
      time.sleep(0.2)
    print(f"ftjax.launch: {first.strip()} (ready in {time.monotonic() - t0:.1f} s)", flush=True)

  def _copy_stdout(self) -> None:
    for line in self.proc.stdout:
      try:
        self._log.write(line)
        self._log.flush()
      except ValueError:  # closed by stop()
        return

  def tail(self, n: int = 2000) -> str:
    self._log.flush()
    with open(self.log_path) as f:
      return "its log ends: " + f.read()[-n:].strip()

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self._log.close()


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
  """(the launcher's options, the server's flags, the client's arguments)."""
  own, client_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
      else (argv, [])
  parser = argparse.ArgumentParser(
      prog="python -m ftjax.launch", description=__doc__.split("\n")[0],
      epilog="Every other --flag goes to python -m ftjax.serve (see its --help).")
  parser.add_argument("client", choices=sorted(CLIENTS))
  parser.add_argument("--url", help="use the ftjax server listening there instead of starting "
                      "one (e.g. http://127.0.0.1:8000)")
  parser.add_argument("--client_bin", help="the client's executable (default: CLIENT on PATH)")
  parser.add_argument("--server_log", help="keep the started server's log at this path "
                      "(default: in the temporary home, removed at exit)")
  parser.add_argument("--api_key", default=os.environ.get(ENV_KEY) or None,
                      help=f"the server's API key, which the client sends (and a started "
                      f"server requires); default ${ENV_KEY}")
  args, serve_flags = parser.parse_known_args(own)
  if args.url and serve_flags:
    parser.error(f"--url uses a running server: the server flags {serve_flags} would be "
                 "ignored; leave out one or the other")
  return args, serve_flags, client_args


def served_key_file(serve_flags: list[str]) -> str | None:
  """The first key of a ``--api_key_file`` among the server's flags (what the client then
  sends), or None."""
  for i, flag in enumerate(serve_flags):
    path = None
    if flag.startswith("--api_key_file="):
      path = flag.split("=", 1)[1]
    elif flag == "--api_key_file" and i + 1 < len(serve_flags):
      path = serve_flags[i + 1]
    if path:
      try:
        return read_key_file(path)[0]
      except ValueError as e:
        raise LaunchError(str(e)) from None
  return None


def main(argv: list[str] | None = None) -> int:
  args, serve_flags, client_args = parse(sys.argv[1:] if argv is None else argv)
  client = CLIENTS[args.client]
  binary = args.client_bin or shutil.which(client.binary)
  if not binary or not os.access(binary, os.X_OK):
    print(f"ftjax.launch: error: {client.binary} ({client.api}) is not installed"
          f"{f' at {args.client_bin}' if args.client_bin else ' on PATH'}: install it with "
          f"`npm install -g {client.package}`, or give --client_bin=PATH", file=sys.stderr)
    return 2
  home = tempfile.mkdtemp(prefix=f"ftjax-launch-{args.client}-")
  server = None
  try:
    key = args.api_key or served_key_file(serve_flags)
    if args.url:
      url = args.url.rstrip("/").removesuffix("/v1")
    else:
      server = Server(serve_flags, args.server_log or os.path.join(home, "server.log"),
                      api_key=args.api_key)
      url = server.url
    model, context = served_model(url, key)
    env = {**os.environ, **client_env(args.client, url, model, context, home, key)}
    env.pop("ANTHROPIC_API_KEY", None)  # Claude Code would prefer a real key to the server's
    print(f"ftjax.launch: {args.client} ({client.api}) -> {url}, model {model!r} with a "
          f"{context}-token context; its configuration is in {home}", flush=True)
    return subprocess.call([binary, *client_args], env=env)
  except LaunchError as e:
    print(f"ftjax.launch: error: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    return 130
  finally:
    if server is not None:
      server.stop()
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
