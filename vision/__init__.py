"""Synchronous torch/PIL code: checkpoint reading, the embedded default model, image decoding and
preprocessing, and the vision encoder. Nothing here imports asyncio.
"""
