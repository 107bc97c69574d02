"""Training of the embedded default model (``python -m ftjax.tiny.train``); the model itself
ships in ``ftjax.assets`` (``ftjax.assets.DEFAULT_MODEL_DIR``)."""
