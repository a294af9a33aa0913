"""Chat templates: validate a conversation and render it to a prompt string.

Contract:
- `validate_messages(messages)` accepts a non-empty list of `{"role": str, "content": str}`
  dicts (extra keys such as "name" pass through untouched) and raises `TokenizerError`
  naming the first bad message otherwise.
- `render_chat(template, messages, ...)` renders a Hugging Face style Jinja chat template the
  way `transformers` does: a sandboxed, immutable environment with `trim_blocks` and
  `lstrip_blocks`, loop controls, a `raise_exception(msg)` helper, a `tojson` filter that keeps
  non-ASCII text as is, `strftime_now(fmt)`, and the variables `messages`,
  `add_generation_prompt`, `bos_token` and `eos_token`, `tools` (OpenAI's function tools)
  when a request has them, and a request's own (`chat_template_kwargs`: Qwen3's
  `enable_thinking`), which cannot replace those (`TEMPLATE_VARIABLES`). With no template it
  renders ChatML.
- `template_of(spec)` is a template a server is told to use instead of the model's
  (`--chat_template`): a name (`TEMPLATES`), a file, or the template's own text;
  `variables_of(text)` the variables it sets for every render (`--chat_template_kwargs`).
- `continue_final(rendered)` cuts a chat rendered without a generation prompt where its final
  message's text ended (marked with `CONTINUE_MARK`), to have the model continue that message
  (an assistant's prefill).
- Any template failure (syntax error, `raise_exception`, undefined variable, sandbox
  violation) becomes a `TokenizerError`, so a bad request maps to a 4xx and never reaches the
  engine.

Non-goals: `documents` (retrieval templates), multimodal content parts (content must already be
a string), and generation-prompt masks for training. Tools reach a template only as given:
rewriting a conversation for a template that knows no tools is `server.tool_requests`' business.
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
from typing import Any

import jinja2
import jinja2.sandbox

from cadence.checkpoints.errors import TokenizerError

# ChatML, the format most small instruct models (SmolLM2, Qwen) were trained on; used when a
# tokenizer ships without a template so that chat requests still work.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Templates by name, for `--chat_template` (llama-server's names).
TEMPLATES = {"chatml": CHATML_TEMPLATE}

# The variables a render sets itself, which a request's or a server's extra variables may not.
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                "raise_exception", "strftime_now"})


def template_of(spec: str) -> str:
    """The chat template `spec` names: one of `TEMPLATES`, a file's text, or `spec` itself
    where it is Jinja (has `{{` or `{%`), as vLLM's --chat-template and llama-server's
    --chat-template / --chat-template-file take it. TokenizerError if it is none of these, or
    does not parse."""
    if spec in TEMPLATES:
        return TEMPLATES[spec]
    if "{{" in spec or "{%" in spec:
        text = spec
    else:
        path = pathlib.Path(spec).expanduser()
        if not path.is_file():
            raise TokenizerError(f"{spec!r} is not a file, a Jinja template, or one of the "
                                 f"templates {', '.join(TEMPLATES)}")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read the chat template {spec}: {e}") from None
    return check_template(text)


def check_template(text: str) -> str:
    """`text` if it parses as a chat template (a request's own, vLLM's `chat_template`: text
    only, never a file), else TokenizerError."""
    _compile(text)
    return text


def variables_of(text: str) -> dict[str, Any]:
    """More variables for every render, from a JSON object (`--chat_template_kwargs`, as
    llama-server's and vLLM's --default-chat-template-kwargs take it), not the render's own
    (`TEMPLATE_VARIABLES`); TokenizerError otherwise."""
    try:
        variables = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"not JSON: {e}") from None
    if not isinstance(variables, dict):
        raise TokenizerError(f"must be a JSON object, got {type(variables).__name__}")
    taken = reserved_variables(variables)
    if taken:
        raise TokenizerError(f"may not set {', '.join(map(repr, taken))}: every render sets them")
    return variables


def reserved_variables(variables: dict[str, Any]) -> list[str]:
    """The names of `variables` that a render sets itself (`TEMPLATE_VARIABLES`), sorted."""
    return sorted(set(variables) & TEMPLATE_VARIABLES)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks the shape of a conversation; returns it unchanged or raises TokenizerError."""
    if not isinstance(messages, list) or not messages:
        raise TokenizerError(
            "messages must be a non-empty list of {'role': str, 'content': str} objects, "
            f"got {type(messages).__name__}" + ("" if messages else " (empty)"))
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TokenizerError(
                f"messages[{i}] must be an object with 'role' and 'content', "
                f"got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise TokenizerError(f"messages[{i}]['role'] must be a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise TokenizerError(
                f"messages[{i}]['content'] must be a string, got {type(content).__name__}; "
                "join text parts into one string before sending")
    return messages


def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot format (e.g. wrong role order).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which would change prompts; templates
    # were written against Python's json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    # Compiling costs ~1 ms; a server renders the same template for every request.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"the chat template does not parse (line {e.lineno}: {e.message}); "
                             "a server can be given another with --chat_template") from e


def render_chat(template: str | None, messages: Any, *, add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None,
                tools: list[dict] | None = None, variables: dict[str, Any] | None = None) -> str:
    """Renders `messages` with `template` (ChatML when None) and returns the prompt text;
    `tools`, if given, is the template's `tools` variable; `variables` are more of them (a
    request's `chat_template_kwargs`, such as Qwen3's `enable_thinking`), beneath the ones
    named here."""
    messages = validate_messages(messages)
    compiled = _compile(template if template is not None else CHATML_TEMPLATE)
    extra = dict(variables or {})
    if tools is not None:
        extra["tools"] = tools
    try:
        return compiled.render({**extra, "messages": messages, "add_generation_prompt": add_generation_prompt,
                                "bos_token": bos_token or "", "eos_token": eos_token or ""})
    except Exception as e:  # noqa: BLE001 - template code can raise anything; none may escape.
        # raise_exception, undefined attributes, sandbox violations and type errors inside
        # the template (e.g. `content + 1`) all mean "this template cannot format this input".
        raise TokenizerError(f"the chat template rejected the messages: {e}") from e


# Appended to a final message's text before rendering, to find where that text ends in the
# prompt (`continue_final`): a private-use character no template writes, around a name.
CONTINUE_MARK = "\ue000cadence-continue\ue000"


def continue_final(rendered: str) -> str:
    """`rendered`, a chat rendered without a generation prompt whose final message's text ended
    with CONTINUE_MARK, cut where the mark is: the model goes on writing that message (an
    assistant's answer begun for it) rather than closing it. TokenizerError if the template
    did not write the mark once (it rewrote the message)."""
    at = rendered.find(CONTINUE_MARK)
    if at < 0 or rendered.count(CONTINUE_MARK) != 1:
        raise TokenizerError("the chat template does not write the final message's text as it "
                             "is, so it cannot be continued")
    return rendered[:at]
