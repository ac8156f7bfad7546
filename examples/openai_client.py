"""Talk to `python -m pipeline serve` with the official openai client (streamed, JSON schema).

Run the server first (`make run` or `.venv/bin/python -m pipeline serve`), then:
.venv/bin/python examples/openai_client.py [http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import sys

from openai import OpenAI

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "maximum": 99999999}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def main() -> None:
    client = OpenAI(base_url=sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1", api_key="unused")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name a city and its population."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
        max_tokens=64,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            print(choice.delta.content or "", end="", flush=True)
        if chunk.usage:
            print(f"\nusage: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens")


if __name__ == "__main__":
    main()
