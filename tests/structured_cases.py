"""What the structured-output tests ask and check, on the tiny model and the real one: JSON
schemas, tools, and how a streamed answer's deltas are put back together."""

from __future__ import annotations

import json

import jsonschema


# Every value bounded, so that even a random model's answer ends well within max_tokens.
SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"}},
        "required": ["name", "age", "member"], "additionalProperties": False},
    "enum_and_array": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 1, "maxItems": 4}},
        "required": ["colour", "scores"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "point": {"type": "object", "properties": {
            # multipleOf bounds the digits: a greedy model may write "1.000..." forever otherwise
            "x": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
            "y": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.01}},
            "required": ["x", "y"], "additionalProperties": False},
        "label": {"type": ["string", "null"], "maxLength": 5}},
        "required": ["point", "label"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
}


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 10},
            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}},
]


TOOL_SCHEMAS = {"get_weather": TOOLS[0]["function"]["parameters"],
                "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}


def assembled(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: its streamed content, tool calls (deltas put together) and finish."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            entry = out.setdefault(choice["index"], {"content": "", "calls": {}, "finish": None})
            delta = choice.get("delta", {})
            entry["content"] += delta.get("content") or choice.get("text") or ""
            for call in delta.get("tool_calls") or []:
                got = entry["calls"].setdefault(call["index"], {"name": None, "arguments": "", "id": None})
                if "id" in call:
                    assert got["id"] is None, "a call's header came twice"
                    got["id"], got["name"] = call["id"], call["function"]["name"]
                got["arguments"] += call["function"].get("arguments", "")
            entry["finish"] = choice["finish_reason"] or entry["finish"]
    return out


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        name = call["function"]["name"] if "function" in call else call["name"]
        arguments = call["function"]["arguments"] if "function" in call else call["arguments"]
        assert name in names
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])
