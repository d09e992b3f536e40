"""OpenAI-compatible API (/v1): chat and completions, files and batches. Wired, not yet built."""
