"""Runtime: loading models, the engine, tokenizers, sampling."""
