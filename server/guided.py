"""Structured output as other servers spell it: vLLM's `guided_*` fields and `structured_outputs`
object, llama-server's `grammar` and `json_schema`. Each becomes a `scheduler.grammar` spec:

    guided_json, structured_outputs.json, json_schema (llama-server)   -> JsonSchema
    guided_regex, structured_outputs.regex                             -> Regex
    guided_choice, structured_outputs.choice                           -> Choice
    guided_grammar, structured_outputs.grammar, grammar (llama-server) -> ContextFree (GBNF or Lark)
    structured_outputs.json_object: true                               -> JsonObject

A schema is closed as `response_format`'s is (`grammar.closed_schema`), and JSON comes out
compact, whatever vLLM's `disable_any_whitespace` or `disable_additional_properties` say (both
are accepted as booleans). A request has one constraint at most: two of these, or one beside
`response_format`, is a 400 naming the second. `guided_decoding_backend` (and
`structured_outputs.disable_fallback`) is accepted and changes nothing: cadence has one
backend, llguidance, which is vLLM's too. What cadence cannot honour (a whitespace pattern,
structural tags) is refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.grammar import Choice, ContextFree, JsonObject, JsonSchema, Regex, Spec, closed_schema

# The request fields read here (every door's: chat, completions, batch lines).
FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
          "guided_whitespace_pattern", "structured_outputs", "grammar", "json_schema")
MAX_CHOICES = 4096
_SO_KINDS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
             "grammar": "guided_grammar"}
_SO_FLAGS = ("json_object", "disable_fallback", "disable_any_whitespace",
             "disable_additional_properties")


def _schema(value: Any, name: str) -> Spec:
    if isinstance(value, str):  # vLLM takes a schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError:
            raise SubmissionError(f'"{name}" must be a JSON schema (an object, or its JSON text)', name) from None
    if not isinstance(value, dict):
        raise SubmissionError(f'"{name}" must be a JSON schema (an object, or its JSON text)', name)
    return JsonSchema(closed_schema(value))


def _spec(kind: str, value: Any, name: str) -> Spec:
    """One constraint's spec; `kind` is its guided_* field's name, `name` the field it came in."""
    if kind == "guided_json":
        return _schema(value, name)
    if kind == "guided_choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise SubmissionError(f'"{name}" must be an array of 1 to {MAX_CHOICES} non-empty strings', name)
        return Choice(tuple(value))
    if not isinstance(value, str) or not value:
        raise SubmissionError(f'"{name}" must be a non-empty string', name)
    return Regex(value) if kind == "guided_regex" else ContextFree(value)


def constraint(entry: dict) -> tuple[Spec, str] | None:
    """The entry's constraint in these fields and the field it came from, or None."""
    found: list[tuple[Spec, str]] = []
    for kind in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if entry.get(kind) is not None:
            found.append((_spec(kind, entry[kind], kind), kind))
    if entry.get("grammar") is not None:
        found.append((_spec("guided_grammar", entry["grammar"], "grammar"), "grammar"))
    if entry.get("json_schema") is not None:
        found.append((_schema(entry["json_schema"], "json_schema"), "json_schema"))
    outputs = entry.get("structured_outputs")
    if outputs is not None:
        found += _structured_outputs(outputs)
    backend = entry.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise SubmissionError('"guided_decoding_backend" must be a string', "guided_decoding_backend")
    if entry.get("guided_whitespace_pattern") is not None:
        raise SubmissionError('"guided_whitespace_pattern" is not supported: cadence writes JSON '
                              "compactly, with json.dumps' separators", "guided_whitespace_pattern")
    if len(found) > 1:
        raise SubmissionError(f'"{found[1][1]}" cannot go with "{found[0][1]}": a request takes one '
                              "constraint", found[1][1])
    return found[0] if found else None


def _structured_outputs(outputs: Any) -> list[tuple[Spec, str]]:
    """vLLM's `structured_outputs` object: its constraints, each named structured_outputs."""
    name = "structured_outputs"
    if not isinstance(outputs, dict):
        raise SubmissionError(f'"{name}" must be an object', name)
    unknown = sorted(set(outputs) - set(_SO_KINDS) - set(_SO_FLAGS) - {"whitespace_pattern", "structural_tag"})
    if unknown:
        raise SubmissionError(f'"{name}" has unknown field(s) {", ".join(unknown)}', name)
    for key in ("whitespace_pattern", "structural_tag"):
        if outputs.get(key) is not None:
            raise SubmissionError(f'"{name}".{key} is not supported by cadence', name)
    for key in _SO_FLAGS:
        if outputs.get(key) is not None and not isinstance(outputs[key], bool):
            raise SubmissionError(f'"{name}".{key} must be true or false', name)
    keys = [key for key in (*_SO_KINDS, "json_object") if outputs.get(key) not in (None, False)]
    if len(keys) > 1:
        raise SubmissionError(f'"{name}" takes one of {", ".join(_SO_KINDS)}, json_object; got '
                              f'{" and ".join(keys)}', name)
    return [(JsonObject() if key == "json_object" else
             _spec(_SO_KINDS[key], outputs[key], f"{name}.{key}"), name) for key in keys]
