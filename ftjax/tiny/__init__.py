"""The embedded default model (``ftjax/assets/default_model``)."""

import os

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets",
                                 "default_model")
