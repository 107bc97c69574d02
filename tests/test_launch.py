"""``python -m ftjax.launch``: the clients' configurations, the error for a client that is not
installed, and a real launch: the server started, a client process pointed at it (here a
Python program using the ``anthropic`` SDK as Claude Code would, from the environment the
launcher gives it), and the server stopped when the client exits. The three agent CLIs
themselves are run by benchmarks/agent_clients.py (they are installed from npm)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tomllib

from ftjax.launch import PLACEHOLDER_KEY, client_env, parse

URL = "http://127.0.0.1:8123"


def test_codex_gets_a_responses_provider_in_its_own_home(tmp_path):
  env = client_env("codex", URL, "default-hybrid", 65536, str(tmp_path))
  assert env == {"CODEX_HOME": str(tmp_path / "codex"), "FTJAX_API_KEY": PLACEHOLDER_KEY}
  with open(tmp_path / "codex" / "config.toml", "rb") as f:
    config = tomllib.load(f)
  assert config["model"] == "default-hybrid" and config["model_provider"] == "ftjax"
  assert config["model_context_window"] == 65536
  assert config["model_providers"]["ftjax"] == {"name": "ftjax", "base_url": URL + "/v1",
                                                "wire_api": "responses",
                                                "env_key": "FTJAX_API_KEY"}


def test_each_client_sends_the_servers_key_from_its_environment_only(tmp_path):
  """With a key, every client gets it through its environment; no file holds it."""
  for name, var in (("claude", "ANTHROPIC_AUTH_TOKEN"), ("codex", "FTJAX_API_KEY"),
                    ("opencode", "FTJAX_API_KEY")):
    home = tmp_path / name
    home.mkdir()
    env = client_env(name, URL, "m", 4096, str(home), api_key="sk-local-123")
    assert env[var] == "sk-local-123"
    for folder, _, files in os.walk(home):
      for f in files:
        assert "sk-local-123" not in open(os.path.join(folder, f)).read()
  with open(tmp_path / "opencode" / "opencode.json") as f:
    assert json.load(f)["provider"]["ftjax"]["options"]["apiKey"] == "{env:FTJAX_API_KEY}"


def test_opencode_gets_a_provider_with_the_context_limit(tmp_path):
  env = client_env("opencode", URL, "m", 4096, str(tmp_path))
  with open(env["OPENCODE_CONFIG"]) as f:
    config = json.load(f)
  assert os.path.dirname(env["OPENCODE_CONFIG"]) == str(tmp_path)
  provider = config["provider"]["ftjax"]
  assert provider["options"]["baseURL"] == URL + "/v1"
  assert provider["models"]["m"]["limit"] == {"context": 4096, "output": 2048}
  assert config["model"] == "ftjax/m"


def test_claude_gets_environment_variables_only(tmp_path):
  env = client_env("claude", URL, "m", 4096, str(tmp_path))
  assert env["ANTHROPIC_BASE_URL"] == URL and env["ANTHROPIC_MODEL"] == "m"
  assert all(env[f"ANTHROPIC_DEFAULT_{a}_MODEL"] == "m" for a in ("OPUS", "SONNET", "HAIKU"))
  assert env["CLAUDE_CONFIG_DIR"].startswith(str(tmp_path))
  assert os.listdir(tmp_path) == ["claude"] and not os.listdir(tmp_path / "claude")


def test_flags_split_between_launcher_server_and_client():
  args, serve, client = parse(["codex", "--model=default", "--client_bin=/x/codex",
                               "--max_seq_len=8192", "--", "exec", "--json", "hi"])
  assert args.client == "codex" and args.client_bin == "/x/codex" and args.url is None
  assert serve == ["--model=default", "--max_seq_len=8192"]
  assert client == ["exec", "--json", "hi"]


def _launch(*argv, env=None, timeout=300):
  return subprocess.run([sys.executable, "-m", "ftjax.launch", *argv], capture_output=True,
                        text=True, timeout=timeout, env=env, check=False)


def test_a_client_that_is_not_installed_says_how_to_install_it(tmp_path):
  env = {**os.environ, "PATH": str(tmp_path)}  # no client on it
  for name, package in (("claude", "@anthropic-ai/claude-code"), ("codex", "@openai/codex"),
                        ("opencode", "opencode-ai")):
    done = _launch(name, env=env)
    assert done.returncode == 2
    assert f"npm install -g {package}" in done.stderr, done.stderr


KEYED_CLIENT = r'''
import os, sys, anthropic
key = os.environ["ANTHROPIC_AUTH_TOKEN"]
url, model = os.environ["ANTHROPIC_BASE_URL"], os.environ["ANTHROPIC_MODEL"]
ask = dict(model=model, max_tokens=2, messages=[{"role": "user", "content": "x ="}])
try:
  anthropic.Anthropic(base_url=url, auth_token="wrong", api_key=None, max_retries=0).messages.create(**ask)
  print("WRONG KEY ACCEPTED", flush=True)
except anthropic.AuthenticationError:
  print("WRONG KEY REFUSED", flush=True)
reply = anthropic.Anthropic(base_url=url, auth_token=key, api_key=None).messages.create(**ask)
print("KEYED REPLY", key, reply.type, reply.stop_reason in ("max_tokens", "end_turn"), flush=True)
'''


def test_launch_passes_the_servers_key_to_the_client(tmp_path):
  """--api_key: the server the launcher starts requires it (from its environment, not its
  command line) and the client sends it."""
  client = tmp_path / "client"
  client.write_text(f"#!{sys.executable}\n{KEYED_CLIENT}")
  client.chmod(0o755)
  env = {k: v for k, v in os.environ.items() if k != "FTJAX_API_KEY"}
  done = _launch("claude", f"--client_bin={client}", "--model=default", "--max_seq_len=512",
                 "--api_key=sk-launch-7", "--", env=env)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "WRONG KEY REFUSED" in done.stdout
  # The reply is sampled (the default temperature): two tokens may end at an end-of-turn
  # token, so either stop reason is a reply (CI once drew end_turn).
  assert "KEYED REPLY sk-launch-7 message True" in done.stdout, done.stdout
  starting = [x for x in done.stdout.splitlines() if "starting" in x]
  assert starting and "sk-launch-7" not in starting[0]


CLIENT = r'''
import os, sys, anthropic
client = anthropic.Anthropic(base_url=os.environ["ANTHROPIC_BASE_URL"],
                             auth_token=os.environ["ANTHROPIC_AUTH_TOKEN"], api_key=None)
reply = client.messages.create(model=os.environ["ANTHROPIC_MODEL"], max_tokens=4,
                               messages=[{"role": "user", "content": sys.argv[1]}],
                               extra_body={"temperature": 0})
print("REPLY", reply.usage.output_tokens, reply.stop_reason, os.environ["ANTHROPIC_BASE_URL"],
      flush=True)
sys.exit(int(sys.argv[2]))
'''


def test_launch_runs_the_client_against_a_server_it_starts_and_stops(tmp_path):
  client = tmp_path / "client"
  client.write_text(f"#!{sys.executable}\n{CLIENT}")
  client.chmod(0o755)
  log = tmp_path / "server.log"
  done = _launch("claude", f"--client_bin={client}", "--model=default", "--max_seq_len=512",
                 f"--server_log={log}", "--log_level=info", "--", "def f():", "3")
  assert done.returncode == 3, done.stdout + done.stderr  # the client's own status
  (line,) = [x for x in done.stdout.splitlines() if x.startswith("REPLY")]
  _, tokens, stop, url = line.split()
  # Greedy: a sampled reply (no temperature) ended at a sampled end of turn after 1 token in a
  # CI run on a clean clone.
  assert (tokens, stop) == ("4", "max_tokens"), line
  assert "512-token context" in done.stdout
  text = log.read_text()
  assert "ftjax request: endpoint=messages" in text
  assert '"POST /v1/messages HTTP/1.1" 200' in text  # uvicorn's access line, from its stdout
  host, port = url.removeprefix("http://").split(":")
  with socket.socket() as s:  # the server went with the client
    assert s.connect_ex((host, int(port))) != 0
