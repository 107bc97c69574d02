"""Where ftjax keeps what it makes once per machine: converted weights, compiled programs,
kernel tuning."""

from __future__ import annotations

import os


def cache_root() -> str:
  """``$FTJAX_CACHE_DIR``, default ``~/.cache/ftjax``."""
  return os.environ.get("FTJAX_CACHE_DIR",
                        os.path.join(os.path.expanduser("~"), ".cache", "ftjax"))
