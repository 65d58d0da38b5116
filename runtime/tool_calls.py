"""Tool-call hygiene: turning what a model wrote into a call a tool server will accept, or a refusal.

Small models get tool calls subtly wrong. Three repairs happen before a call leaves the runtime:

- Arguments are parsed as JSON; anything else is refused with the parse error.
- Scalars are coerced to the type the tool's input schema asks for ("3" for an integer, 3 for a
  string, "true" for a boolean), then the arguments are validated against the schema. A call that
  still does not fit is refused with the expected shape, so the model can fix it on its next turn
  instead of the tool failing silently or doing the wrong thing.
- A call written as text instead of a tool call (`{"name": "lookup", "parameters": {...}}`, or
  Llama's `<function=lookup>{...}</function>`) is recovered when it names an offered tool.

Refusals count as failed tool calls; the model gets the message as the tool's result.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import jsonschema


class ArgumentError(ValueError):
    """The arguments cannot be sent to the tool; the message is what the model is told."""


@dataclass(frozen=True)
class ToolCall:
    """One call as the model asked for it: its id, tool name and raw JSON arguments."""

    id: str
    name: str
    arguments: str

    def as_message_part(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def calls_in(message: dict[str, Any]) -> list[ToolCall]:
    """The tool calls of an assistant message in OpenAI's shape (missing ids are made up)."""
    calls = []
    for part in message.get("tool_calls") or []:
        fn = part.get("function") or {}
        arguments = fn.get("arguments")
        if not isinstance(arguments, str):
            # Some servers send the arguments as an object; the conversation wants a string.
            arguments = json.dumps(arguments if arguments is not None else {})
        calls.append(
            ToolCall(id=part.get("id") or _new_id(), name=str(fn.get("name") or ""), arguments=arguments)
        )
    return calls


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_FUNCTION_TAG = re.compile(r"<function=([\w.-]+)>\s*(\{.*?\})\s*</function>", re.DOTALL)


def recover_text_calls(content: str | None, offered: set[str]) -> list[ToolCall]:
    """Tool calls a model wrote into its text instead of `tool_calls`, if the text is nothing else.

    Only whole-reply forms are recovered, and only for offered tools, so that an answer which
    merely mentions a tool by name is never mistaken for a call.
    """
    if not content or not offered:
        return []
    text = content.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    tagged = _FUNCTION_TAG.findall(text)
    if tagged and not _FUNCTION_TAG.sub("", text).strip():
        return [ToolCall(_new_id(), name, args) for name, args in tagged if name in offered]
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return []
    candidates = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for c in candidates:
        if not isinstance(c, dict):
            return []
        if isinstance(c.get("function"), dict):
            c = c["function"]
        name = c.get("name")
        args = c.get("parameters", c.get("arguments", {}))
        if name not in offered or not isinstance(args, dict | str):
            return []
        calls.append(ToolCall(_new_id(), name, args if isinstance(args, str) else json.dumps(args)))
    return calls


def prepare_arguments(call: ToolCall, schema: dict[str, Any] | None) -> dict[str, Any]:
    """The call's arguments as an object that fits `schema`, or `ArgumentError` saying why not."""
    raw = call.arguments.strip() or "{}"
    try:
        arguments = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ArgumentError(f"the arguments of {call.name} are not valid JSON ({e.msg} at {e.pos})") from None
    if not isinstance(arguments, dict):
        raise ArgumentError(
            f"the arguments of {call.name} must be a JSON object, expected {expected_shape(schema)}"
        )
    if not schema:
        return arguments
    arguments = coerce(arguments, schema)
    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    except jsonschema.exceptions.SchemaError:
        # A tool server's broken schema is not the model's fault; let the server judge the call.
        return arguments
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        raise ArgumentError(
            f"invalid arguments for {call.name}: {f'{where}: ' if where else ''}{error.message}; "
            f"expected {expected_shape(schema)}"
        )
    return arguments


_SCALARS = ("string", "integer", "number", "boolean")


def coerce(arguments: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Converts top-level scalar arguments to the single scalar type their property declares."""
    properties = schema.get("properties") or {}
    out = dict(arguments)
    for key, value in arguments.items():
        wanted = _scalar_type(properties.get(key))
        if wanted is not None:
            out[key] = _coerce_scalar(value, wanted)
    return out


def _scalar_type(prop: Any) -> str | None:
    if not isinstance(prop, dict):
        return None
    t = prop.get("type")
    if isinstance(t, list):
        # ["integer", "null"] and the like: coerce toward the one non-null scalar.
        non_null = [x for x in t if x != "null"]
        t = non_null[0] if len(non_null) == 1 else None
    if t is None and isinstance(prop.get("anyOf"), list):
        options = [o.get("type") for o in prop["anyOf"] if isinstance(o, dict) and o.get("type") != "null"]
        t = options[0] if len(options) == 1 else None
    return t if t in _SCALARS else None


def _coerce_scalar(value: Any, wanted: str) -> Any:
    if value is None or isinstance(value, dict | list):
        return value
    if wanted == "string":
        if isinstance(value, bool):
            return "true" if value else "false"
        return value if isinstance(value, str) else json.dumps(value)
    if wanted == "boolean" and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if wanted in ("integer", "number") and isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return value
        if wanted == "integer":
            return int(number) if number.is_integer() else value
        return int(number) if number.is_integer() and "." not in value else number
    if wanted == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def expected_shape(schema: dict[str, Any] | None) -> str:
    """A one-line example of the arguments a schema wants, e.g. {"query": "<string>"}."""
    properties = (schema or {}).get("properties") or {}
    if not properties:
        return "a JSON object"
    required = set((schema or {}).get("required") or [])
    parts = []
    for name, prop in properties.items():
        kind = prop.get("type", "value") if isinstance(prop, dict) else "value"
        if isinstance(kind, list):
            kind = "|".join(str(k) for k in kind)
        parts.append(f'"{name}": <{kind}{"" if name in required else ", optional"}>')
    return "{" + ", ".join(parts) + "}"
