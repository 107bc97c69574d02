"""API keys: who may use the server, and who may change it (issue 54, item 2).

With keys configured (``ServerConfig.api_keys``: ``--api_key``, ``--api_key_file``,
``FTJAX_API_KEY``), every route but ``GET /health`` needs one, given as OpenAI's
``Authorization: Bearer KEY`` or Anthropic's ``x-api-key: KEY``. A request without a valid key
is answered 401 in its API's own error shape (Anthropic's for ``/v1/messages``, OpenAI's
elsewhere) with ``WWW-Authenticate: Bearer``, before its body is read. With admin keys
(``admin_keys``: ``--admin_key``, ``--admin_key_file``, ``FTJAX_ADMIN_KEY``), the controls
(``POST /v1/cache``, which resizes the expert cache for everyone) need one of them (403 for
another valid key); an admin key is also a valid key everywhere else. Admin keys alone leave
the other routes open and guard only the controls.

Keys are compared as SHA-256 digests with ``hmac.compare_digest`` against every configured
key, without stopping at a match, so the time a check takes says nothing about how much of a
key was right, nor which key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os

from fastapi.responses import JSONResponse

from ftjax.server import anthropic
from ftjax.server.protocol import ApiError

OPEN_ROUTES = frozenset({"/health"})
ADMIN_ROUTES = frozenset({("POST", "/v1/cache")})
ENV_KEY, ENV_ADMIN_KEY = "FTJAX_API_KEY", "FTJAX_ADMIN_KEY"


def _digest(key: str) -> bytes:
  return hashlib.sha256(key.encode()).digest()


def check_key(key: str, source: str) -> str:
  """``key`` if it can be sent in a header, else a ValueError naming ``source``."""
  if not isinstance(key, str) or not key:
    raise ValueError(f"{source}: an API key must be a non-empty string")
  if any(c.isspace() for c in key) or not key.isprintable() or not key.isascii():
    raise ValueError(f"{source}: an API key must be printable ASCII without spaces (a header "
                     "value), got one with other characters")
  return key


def read_key_file(path: str) -> list[str]:
  """The keys of a file, one a line; blank lines and lines starting with ``#`` are skipped."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise ValueError(f"cannot read the API key file {path}: {e.strerror or e}") from None
  except UnicodeDecodeError:
    raise ValueError(f"the API key file {path} is not UTF-8 text (one key a line)") from None
  keys = [check_key(line.strip(), f"{path}, line {i + 1}")
          for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
  if not keys:
    raise ValueError(f"the API key file {path} holds no key (one a line; # starts a comment)")
  return keys


def gather_keys(flag: str | None, path: str | None, env_name: str,
                environ=os.environ) -> tuple[str, ...]:
  """The keys of one kind from a flag's value, a key file and the environment variable
  ``env_name`` (read when neither of the others is given)."""
  keys = []
  if flag:
    keys.append(check_key(flag, "the API key given on the command line"))
  if path:
    keys += read_key_file(path)
  if not keys and environ.get(env_name):
    keys.append(check_key(environ[env_name], env_name))
  return tuple(dict.fromkeys(keys))


class ApiKeys:
  """The configured keys, kept only as digests."""

  def __init__(self, keys=(), admin_keys=()):
    self._keys = [_digest(k) for k in keys]
    self._admin = [_digest(k) for k in admin_keys]

  @property
  def required(self) -> bool:
    return bool(self._keys)

  @property
  def admin_required(self) -> bool:
    return bool(self._admin)

  @staticmethod
  def _matches(presented: str | None, digests: list[bytes]) -> bool:
    probe = _digest(presented or "")
    found = False
    for digest in digests:  # every one compared: no early exit
      found |= hmac.compare_digest(probe, digest)
    return found and presented is not None

  def allows(self, presented: str | None) -> bool:
    """Whether a request with ``presented`` may use the server."""
    if not self._keys:
      return True
    return self._matches(presented, self._keys + self._admin)

  def allows_admin(self, presented: str | None) -> bool:
    """Whether a request with ``presented`` may use the controls."""
    if self._admin:
      return self._matches(presented, self._admin)
    return self.allows(presented)


def presented_key(headers: dict[bytes, bytes]) -> str | None:
  """The key a request gives: ``Authorization: Bearer KEY`` or ``x-api-key: KEY``."""
  auth = headers.get(b"authorization")
  if auth is not None:
    scheme, _, value = auth.decode("latin-1").strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
      return value.strip()
  key = headers.get(b"x-api-key")
  if key is not None and key.strip():
    return key.decode("latin-1").strip()
  return None


def error_response(path: str, error: ApiError) -> JSONResponse:
  body = anthropic.error_body(error) if path.startswith("/v1/messages") else error.body()
  return JSONResponse(body, status_code=error.status, headers=error.headers)


class RequireKey:
  """ASGI middleware: the key check above, before a route (or the body limit) runs.
  ``rejected(path, status)`` is told of each refusal (the server's metrics)."""

  def __init__(self, app, keys: ApiKeys, rejected=None):
    self.app, self.keys, self.rejected = app, keys, rejected

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
      return await self.app(scope, receive, send)
    presented = presented_key(dict(scope.get("headers", ())))
    path, method = scope["path"], scope["method"]
    error = None
    if not self.keys.allows(presented):
      error = ApiError(401, "a valid API key is required: send it as 'Authorization: Bearer "
                       "KEY' or 'x-api-key: KEY'" if presented is None else
                       "the API key given is not valid for this server", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    elif (method, path) in ADMIN_ROUTES and not self.keys.allows_admin(presented):
      error = ApiError(401 if presented is None else 403,
                       f"{method} {path} changes the server for everyone: it needs an admin key "
                       "(--admin_key, --admin_key_file or FTJAX_ADMIN_KEY)",
                       code="admin_key_required",
                       headers={"WWW-Authenticate": "Bearer"} if presented is None else None)
    if error is None:
      return await self.app(scope, receive, send)
    if self.rejected is not None:
      self.rejected(path, error.status)
    return await error_response(path, error)(scope, receive, send)


def exposure_warning(host: str, port: int, keys: ApiKeys) -> str | None:
  """The warning for a server that listens beyond this machine without an API key (None when
  it listens on loopback only, or has keys)."""
  if keys.required:
    return None
  try:
    loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
  except ValueError:
    loopback = False
  if loopback:
    return None
  who = ("every machine that can reach this one on any of its networks"
         if host in ("0.0.0.0", "::", "") else f"every machine that can reach {host}")
  control = (" and resize the expert cache (POST /v1/cache)" if not keys.admin_required
             else "")
  return (f"ftjax.serve: warning: listening on {host}:{port} without an API key: {who} can "
          f"run the model{control}; give --api_key, --api_key_file or FTJAX_API_KEY, or "
          "listen on 127.0.0.1")
