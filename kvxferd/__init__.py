"""kvxferd: the KV cache transfer daemon for disaggregated LLM serving."""

__version__ = "0.1.0"
