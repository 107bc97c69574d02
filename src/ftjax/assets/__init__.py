"""Files shipped inside the package: the embedded default models and a routing trace.

``DEFAULT_MODEL_DIR``: the trained default model (FTW directory; its card is
``ftjax/tiny/README.md``, ``python -m ftjax.tiny.train`` retrains it).
``DEFAULT_HYBRID_MODEL_DIR``: the trained hybrid (Gated DeltaNet + attention) default model
(``python -m ftjax.tiny.train --arch=hybrid``).
``EMBEDDED_MODELS``: the names ``ftjax.load`` and ``--model`` accept for them.
``DEFAULT_TRACE``: that model's routing trace (``ftjax.traces.Trace``), the default input of
``python -m ftjax.sweep`` (``benchmarks/sweep.py`` captures it).
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL_DIR = os.path.join(_HERE, "default_model")
DEFAULT_HYBRID_MODEL_DIR = os.path.join(_HERE, "default_hybrid_model")
DEFAULT_TRACE = os.path.join(_HERE, "default_trace.npz")
EMBEDDED_MODELS = {"default": DEFAULT_MODEL_DIR, "default-hybrid": DEFAULT_HYBRID_MODEL_DIR}

__all__ = ["DEFAULT_MODEL_DIR", "DEFAULT_HYBRID_MODEL_DIR", "DEFAULT_TRACE", "EMBEDDED_MODELS"]
