"""Tokenizers (Hugging Face, GGUF), chat templates, incremental detokenization."""
