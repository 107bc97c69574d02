"""An OpenAI-compatible HTTP server on ftjax sessions (``python -m ftjax.serve``).

``create_app(engine, ServerConfig(...))`` is the FastAPI app; ``BackgroundServer(app)`` runs
it in a thread. See ``ftjax.server.app`` for how requests become engine work.
"""

from ftjax.server.app import BackgroundServer, ServerConfig, create_app
from ftjax.server.outputs import ReplyParser, StopMatcher
from ftjax.server.pool import SessionPool

__all__ = ["BackgroundServer", "ReplyParser", "ServerConfig", "SessionPool", "StopMatcher",
           "create_app"]
