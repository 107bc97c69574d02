"""API keys (ftjax.server.auth) on a real server on 127.0.0.1, with the real ``openai`` and
``anthropic`` clients: every route but /health refuses a request without a valid key with a
401 in its API's own shape, before the request runs; either header works; admin keys guard
``POST /v1/cache``; keys from flags, files and the environment; and the warning of a server
that listens beyond loopback without a key."""

from __future__ import annotations

import http.client
import json

import anthropic
import openai
import pytest

import ftjax
from ftjax.server import BackgroundServer, ServerConfig, create_app
from ftjax.server.auth import ApiKeys, exposure_warning, gather_keys, read_key_file

KEY, OTHER, ADMIN = "sk-user-1", "sk-user-2", "sk-admin-9"

# Every route the server has, with a body that would be valid (so that only the key decides).
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = [
    ("GET", "/", None), ("HEAD", "/", None), ("GET", "/v1/models", None),
    ("GET", "/v1/models/default", None), ("GET", "/metrics", None), ("GET", "/v1/cache", None),
    ("POST", "/v1/cache", {"slots": 4}), ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 2}),
    ("POST", "/v1/messages", CHAT), ("POST", "/v1/messages/count_tokens",
                                     {"model": "default", "messages": CHAT["messages"]}),
    ("POST", "/v1/responses", {"model": "default", "input": "hi", "max_output_tokens": 2}),
    ("GET", "/no/such/route", None),
]


@pytest.fixture(scope="module")
def served():
  engine = ftjax.Engine(ftjax.load("default"), max_seq_len=512, cache_slots=8,
                        policy="lru_fill")
  app = create_app(engine, ServerConfig(model_name="default", api_keys=(KEY, OTHER),
                                        admin_keys=(ADMIN,)))
  server = BackgroundServer(app)
  yield server
  server.stop()


def _call(server, method, path, body=None, headers=None):
  conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
  conn.request(method, path, body=None if body is None else json.dumps(body),
               headers={"Content-Type": "application/json", **(headers or {})})
  resp = conn.getresponse()
  raw = resp.read()
  conn.close()
  return resp.status, dict(resp.getheaders()), (json.loads(raw) if raw else None)


@pytest.mark.parametrize("method,path,body", ROUTES)
@pytest.mark.parametrize("given", ["none", "wrong", "bearer_prefix", "empty_bearer"])
def test_every_route_refuses_a_missing_or_wrong_key(served, method, path, body, given):
  headers = {"none": {}, "wrong": {"Authorization": "Bearer sk-nope"},
             "bearer_prefix": {"Authorization": f"Bearer {KEY[:-1]}"},
             "empty_bearer": {"Authorization": "Bearer "}}[given]
  status, head, data = _call(served, method, path, body, headers)
  assert status == 401
  assert head.get("www-authenticate") == "Bearer"
  if method == "HEAD":
    return
  if path.startswith("/v1/messages"):
    assert data == {"type": "error", "error": {"type": "authentication_error",
                                               "message": data["error"]["message"]}}
  else:
    assert data["error"]["type"] == "invalid_request_error"
    assert data["error"]["code"] == "invalid_api_key"
  assert "API key" in (data["error"]["message"])


def test_health_needs_no_key_and_either_header_works(served):
  assert _call(served, "GET", "/health")[0] == 200
  for headers in ({"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {OTHER}"},
                  {"x-api-key": KEY}, {"Authorization": f"Bearer {ADMIN}"}):
    status, _, data = _call(served, "GET", "/v1/models", headers=headers)
    assert status == 200 and data["data"][0]["id"] == "default"


def test_the_openai_client_with_and_without_the_key(served):
  bad = openai.OpenAI(base_url=served.url + "/v1", api_key="sk-nope", max_retries=0)
  with pytest.raises(openai.AuthenticationError) as e:
    bad.chat.completions.create(model="default", messages=CHAT["messages"], max_tokens=2)
  assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
  for call in (lambda c: c.models.list(),
               lambda c: c.completions.create(model="default", prompt="x", max_tokens=2),
               lambda c: c.responses.create(model="default", input="hi", max_output_tokens=2)):
    with pytest.raises(openai.AuthenticationError):
      call(bad)
  good = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
  reply = good.chat.completions.create(model="default", messages=CHAT["messages"],
                                       max_tokens=2, temperature=0)
  assert reply.choices[0].finish_reason in ("length", "stop")
  assert good.completions.create(model="default", prompt="def f(", max_tokens=2).usage


def test_the_anthropic_client_with_and_without_the_key(served):
  for kwargs in ({"api_key": "sk-nope"}, {"auth_token": "sk-nope", "api_key": None}):
    bad = anthropic.Anthropic(base_url=served.url, max_retries=0, **kwargs)
    with pytest.raises(anthropic.AuthenticationError) as e:
      bad.messages.create(model="default", max_tokens=2, messages=CHAT["messages"])
    assert e.value.status_code == 401
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
      bad.messages.count_tokens(model="default", messages=CHAT["messages"])
  for kwargs in ({"api_key": KEY}, {"auth_token": OTHER, "api_key": None}):
    good = anthropic.Anthropic(base_url=served.url, max_retries=0, **kwargs)
    reply = good.messages.create(model="default", max_tokens=2, messages=CHAT["messages"])
    assert reply.usage.output_tokens >= 1


def test_the_cache_control_needs_the_admin_key(served):
  status, _, data = _call(served, "POST", "/v1/cache", {"slots": 4},
                          {"Authorization": f"Bearer {KEY}"})
  assert status == 403 and data["error"]["code"] == "admin_key_required"
  assert _call(served, "GET", "/v1/cache", headers={"x-api-key": KEY})[0] == 200
  status, _, data = _call(served, "POST", "/v1/cache", {"slots": 4}, {"x-api-key": ADMIN})
  assert status == 200 and data["slots"] == 4
  # Refusals are counted like any other rejected request.
  _call(served, "POST", "/v1/chat/completions", CHAT)
  metrics = http.client.HTTPConnection(served.host, served.port, timeout=30)
  metrics.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
  text = metrics.getresponse().read().decode()
  assert 'ftjax_requests_total{endpoint="chat",status="401"}' in text
  assert 'ftjax_requests_total{endpoint="other",status="403"}' in text


def test_admin_keys_alone_guard_only_the_controls():
  keys = ApiKeys((), (ADMIN,))
  assert keys.allows(None) and keys.allows("anything")
  assert not keys.allows_admin(None) and not keys.allows_admin(KEY) and keys.allows_admin(ADMIN)
  keys = ApiKeys((KEY,))
  assert keys.allows_admin(KEY) and not keys.allows_admin(OTHER) and not keys.allows(None)


def test_keys_from_flags_files_and_the_environment(tmp_path):
  path = tmp_path / "keys"
  path.write_text(f"# team keys\n{KEY}\n\n  {OTHER}  \n{KEY}\n")
  assert read_key_file(str(path)) == [KEY, OTHER, KEY]
  assert gather_keys(None, str(path), "X", environ={}) == (KEY, OTHER)
  assert gather_keys(ADMIN, str(path), "X", environ={}) == (ADMIN, KEY, OTHER)
  assert gather_keys(None, None, "X", environ={"X": ADMIN}) == (ADMIN,)
  assert gather_keys(KEY, None, "X", environ={"X": ADMIN}) == (KEY,)  # the flag wins
  assert gather_keys(None, None, "X", environ={}) == ()


@pytest.mark.parametrize("content,message", [
    ("# only a comment\n\n", "holds no key"), ("sk-a b\n", "without spaces"),
    (b"\xff\xfe", "not UTF-8"), (None, "cannot read")])
def test_bad_key_files_are_named(tmp_path, content, message):
  path = tmp_path / "keys"
  if isinstance(content, bytes):
    path.write_bytes(content)
  elif content is not None:
    path.write_text(content)
  with pytest.raises(ValueError, match=message):
    read_key_file(str(path))


def test_bad_configured_keys_are_named():
  with pytest.raises(ValueError, match="sequence of keys"):
    ServerConfig(api_keys="sk-one")
  with pytest.raises(ValueError, match="without spaces"):
    ServerConfig(api_keys=("sk one",))
  with pytest.raises(ValueError, match="non-empty"):
    ServerConfig(admin_keys=("",))


def test_a_server_open_beyond_loopback_is_warned_about():
  open_keys, keyed = ApiKeys(), ApiKeys((KEY,))
  for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
    assert exposure_warning(host, 8000, open_keys) is None
  warning = exposure_warning("0.0.0.0", 8000, open_keys)
  assert "0.0.0.0:8000 without an API key" in warning
  assert "any of its networks" in warning and "POST /v1/cache" in warning
  assert "--api_key" in warning and "FTJAX_API_KEY" in warning
  assert "every machine that can reach 192.168.1.5" in exposure_warning("192.168.1.5", 80,
                                                                        open_keys)
  assert exposure_warning("0.0.0.0", 8000, keyed) is None
