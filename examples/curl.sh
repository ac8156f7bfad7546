#!/usr/bin/env bash
# One image request with a JSON schema, by curl, against `python -m pipeline serve`.
# Usage: examples/curl.sh [http://127.0.0.1:8000]
set -euo pipefail
BASE=${1:-http://127.0.0.1:8000}
# a 2x2 red PNG
IMG="iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP8z8DAwMDAxMDAwMDAAAANHQEDasKb6QAAAABJRU5ErkJggg=="
curl -sS "$BASE/health"; echo
curl -sS "$BASE/v1/chat/completions" -H 'Content-Type: application/json' -d @- <<JSON
{
  "messages": [{"role": "user", "content": [
    {"type": "text", "text": "What colour is this image?"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,$IMG"}}
  ]}],
  "response_format": {"type": "json_schema", "json_schema": {"name": "colour", "schema": {
    "type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["colour"], "additionalProperties": false}}},
  "max_tokens": 32,
  "temperature": 0
}
JSON
echo
