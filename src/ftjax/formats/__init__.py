"""Weight formats: FTW (ftjax's own) and the Hugging Face safetensors import."""
