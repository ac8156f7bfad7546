"""Prepare and decode one image request with a JSON schema through the Python API.

Run: .venv/bin/python examples/python_api.py
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

from PIL import Image, ImageDraw

from pipeline import Pipeline, PipelineConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "shape": {"type": "string", "enum": ["circle", "square", "triangle"]},
        "color": {"type": "string", "maxLength": 12},
    },
    "required": ["shape", "color"],
    "additionalProperties": False,
}


def image_data_url() -> str:
    image = Image.new("RGB", (256, 256), "white")
    ImageDraw.Draw(image).ellipse((48, 48, 208, 208), fill="orange")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def main() -> None:
    async with Pipeline(PipelineConfig()) as pipe:  # the embedded default model
        handle = await pipe.submit(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What shape is this?"},
                            {"type": "image_url", "image_url": {"url": image_data_url()}},
                        ],
                    }
                ],
                "response_format": {"type": "json_schema", "json_schema": {"name": "shape", "schema": SCHEMA}},
                "max_tokens": 64,
                "temperature": 0,
            }
        )
        async for delta in handle:  # streamed text deltas
            print(delta.text, end="", flush=True)
        print()
        result = await handle.result()
        print("parsed:", json.loads(result.text))
        print("finish:", result.finish_reason, "usage:", result.prompt_tokens, "+", result.completion_tokens)
        print("stage timings (s):", {k: round(v, 4) for k, v in result.timings.items()})


if __name__ == "__main__":
    asyncio.run(main())
