"""Prefix-aware aiohttp gateway in front of llmserve (or vLLM) engines."""
