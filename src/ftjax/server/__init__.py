"""An OpenAI-compatible HTTP server on ftjax sessions (``python -m ftjax.serve``).

``create_app(engine, ServerConfig(...))`` is the FastAPI app; ``BackgroundServer(app)`` runs
it in a thread. See ``ftjax.server.app`` for how requests become engine work.
"""

from ftjax.server.app import BackgroundServer, DrainingServer, ServerConfig, create_app
from ftjax.server.outputs import ReplyParser, StopMatcher
from ftjax.server.pool import SessionPool

__all__ = ["BackgroundServer", "DrainingServer", "ReplyParser", "ServerConfig", "SessionPool", "StopMatcher",
           "create_app"]
