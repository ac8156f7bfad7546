"""The two tools and the question the family tool tests ask every model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MESSAGES", "SCHEMAS", "TIME", "TOOLS", "WEATHER", "FamilyDir"]

FamilyDir = Callable[[str], Path]
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
