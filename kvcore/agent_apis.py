"""Anthropic Messages and OpenAI Responses requests as the chat conversation vLLM renders.

vLLM serves both APIs by converting each request into a chat-completions request and rendering
that through the model's chat template. The router must tokenize exactly what the replica
will, so it converts the same way: these functions follow vLLM 0.32's own conversion
(``AnthropicServingMessages.to_chat_completion_request`` in ``vllm/entrypoints/anthropic/
serving.py``; ``construct_input_messages`` and ``construct_tool_dicts`` in ``vllm/entrypoints/
openai/responses/utils.py``), step for step, and check the fields vLLM's request models check,
so a request vLLM would refuse gets a clear 400 here first. Facts, not code, carried over.

The result is a ``ChatConversion``: messages, tools and template options as a chat request
would carry them, which the router's chat tokenization renders like any chat. Pure: no I/O.
The emulated replica uses the same conversion, so the two cannot drift.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeGuard

import jinja2.ext
import jinja2.sandbox

# Claude Code's attribution header (a per-request hash): vLLM drops a system block that starts
# with it here, and a system text's first line when rendering (hf.py).
from .client_text import shown
from .tokenizer.hf import BILLING_HEADER

# Content block types vLLM's AnthropicContentBlock accepts (any other is a 400 there).
MESSAGE_BLOCK_TYPES = frozenset(
    (
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    )
)
_ROLES = ("user", "assistant", "system")
_TOOL_CHOICES = ("auto", "any", "tool", "none")
_THINKING = ("enabled", "disabled", "adaptive")
# vLLM flattens a namespace tool's functions to "<namespace>__<name>".
NAMESPACE_SEPARATOR = "__"
# Responses' custom tools are shown to the template as a one-string function.
CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {
        "input": {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": ["input"],
    "additionalProperties": False,
}


class AgentRequestError(ValueError):
    """A request vLLM would refuse: what is wrong, and where (``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ChatConversion:
    """What the chat template gets for one request, as vLLM builds it."""

    messages: list[dict[str, Any]]
    # The same conversation with inline system messages merged into the first (vLLM does so
    # for templates that require system-first ordering); None when there are none to merge.
    merged_messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False

    def chat_options(self) -> dict[str, Any]:
        """The options a chat request with these fields hands the template."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "tools": self.tools,
            "chat_template_kwargs": self.chat_template_kwargs,
            "documents": None,
            "reasoning_effort": self.reasoning_effort,
        }


# -- Anthropic Messages ------------------------------------------------------------------


def check_messages_request(body: Any, count_tokens: bool = False) -> dict[str, Any]:
    """The body of /v1/messages (or /v1/messages/count_tokens), checked as vLLM's request
    model checks it; AgentRequestError names the first field that is wrong."""
    if not isinstance(body, dict):
        raise AgentRequestError("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise AgentRequestError("'model' is required and must be a non-empty string.", "model")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise AgentRequestError("'messages' is required and must be a list.", "messages")
    if not count_tokens:
        max_tokens = body.get("max_tokens")
        if not _is_int(max_tokens) or max_tokens <= 0:
            raise AgentRequestError(
                "'max_tokens' is required and must be a positive integer.", "max_tokens"
            )
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise AgentRequestError("'stream' must be a boolean.", "stream")
        stops = body.get("stop_sequences")
        if stops is not None and not (
            isinstance(stops, list) and all(isinstance(s, str) for s in stops)
        ):
            raise AgentRequestError("'stop_sequences' must be a list of strings.", "stop_sequences")
    for i, message in enumerate(messages):
        _check_message(message, f"messages[{i}]")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_blocks(system, "system")
    _check_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in _TOOL_CHOICES:
            raise AgentRequestError(
                "'tool_choice.type' must be one of auto, any, tool, none.", "tool_choice"
            )
        if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
            raise AgentRequestError(
                "'tool_choice.name' is required for type 'tool'.", "tool_choice"
            )
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in _THINKING:
            raise AgentRequestError(
                "'thinking.type' must be one of enabled, disabled, adaptive.", "thinking"
            )
        if thinking["type"] == "enabled":
            budget = thinking.get("budget_tokens")
            if not _is_int(budget) or budget < 1024:
                raise AgentRequestError(
                    "'thinking.budget_tokens' must be an integer >= 1024.", "thinking.budget_tokens"
                )
            if not count_tokens and budget >= body["max_tokens"]:
                raise AgentRequestError(
                    "'thinking.budget_tokens' must be less than 'max_tokens'.",
                    "thinking.budget_tokens",
                )
    for key in ("metadata", "chat_template_kwargs", "output_config"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise AgentRequestError(f"'{key}' must be an object.", key)
    return body


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise AgentRequestError(f"'{where}' must be an object.", where)
    if message.get("role") not in _ROLES:
        raise AgentRequestError(
            f"'{where}.role' must be one of user, assistant, system.", f"{where}.role"
        )
    content = message.get("content")
    if not isinstance(content, str):
        _check_blocks(content, f"{where}.content")
        assert isinstance(content, list)
        if message["role"] != "system":
            for j, block in enumerate(content):
                if block["type"] in ("tool_addition", "tool_removal"):
                    raise AgentRequestError(
                        f'{block["type"]} blocks are only allowed in messages with role "system"',
                        f"{where}.content[{j}]",
                    )


def _check_blocks(blocks: Any, where: str) -> None:
    if not isinstance(blocks, list):
        raise AgentRequestError(f"'{where}' must be a string or a list of content blocks.", where)
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or block.get("type") not in MESSAGE_BLOCK_TYPES:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise AgentRequestError(f"'{at}' has an unsupported content block type: {kind!r}.", at)
        for key in ("text", "thinking", "id", "name", "tool_use_id"):
            value = block.get(key)
            if value is not None and not isinstance(value, str):
                raise AgentRequestError(f"'{at}.{key}' must be a string.", f"{at}.{key}")
        source = block.get("source")
        if source is not None and not isinstance(source, dict):
            raise AgentRequestError(f"'{at}.source' must be an object.", f"{at}.source")
        change = block.get("tool")
        if block["type"] in ("tool_addition", "tool_removal") and not _tool_change_ok(change):
            raise AgentRequestError(
                f"'{at}.tool' must name a declared tool or give its definition.", f"{at}.tool"
            )
        tool_input = block.get("input")
        if (
            block["type"] == "tool_use"
            and tool_input is not None
            and not isinstance(tool_input, dict)
        ):
            raise AgentRequestError(f"'{at}.input' must be an object.", f"{at}.input")


def _tool_change_ok(change: Any) -> bool:
    """A tool_addition / tool_removal's ``tool``: a name, or a definition (name, schema)."""
    if not isinstance(change, dict):
        return False
    definition = change.get("definition")
    if definition is not None:
        return (
            isinstance(definition, dict)
            and isinstance(definition.get("name"), str)
            and isinstance(definition.get("input_schema", {}), dict)
        )
    return isinstance(change.get("name"), str)


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise AgentRequestError("'tools' must be a list.", "tools")
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise AgentRequestError(f"'{at}.name' is required and must be a string.", f"{at}.name")
        if "input_schema" in tool and not isinstance(tool["input_schema"], dict):
            raise AgentRequestError(f"'{at}.input_schema' must be an object.", f"{at}.input_schema")


def messages_to_chat(body: dict[str, Any]) -> ChatConversion:
    """A checked Messages body as vLLM's chat conversion builds it (``disabled`` thinking as
    effort "none", vLLM's default for templates that honour it)."""
    system = _system_text(body.get("system"))
    inline = [m for m in body["messages"] if m["role"] == "system"]
    messages = _convert_messages(body, system, merge_inline=False)
    merged = _convert_messages(body, system, merge_inline=True) if inline else None
    effort: str | None = None
    output_config = body.get("output_config")
    if isinstance(output_config, dict) and isinstance(output_config.get("effort"), str):
        effort = output_config["effort"]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = "none"
    tools = _resolved_tools(body)
    chat_tools = None
    if tools is not None:
        chat_tools = [
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool.get("description"),
                    "parameters": _with_object_type(tool.get("input_schema") or {}),
                    "strict": tool.get("strict"),
                    "defer_loading": tool.get("defer_loading"),
                },
            }
            for tool in tools
        ]
    return ChatConversion(
        messages,
        merged,
        chat_tools,
        effort,
        body.get("chat_template_kwargs"),
    )


def _with_object_type(schema: dict[str, Any]) -> dict[str, Any]:
    # vLLM's AnthropicTool validator sets "type": "object" where the schema has none: last,
    # and the template's tojson keeps the keys' order.
    return schema if "type" in schema else {**schema, "type": "object"}


def _system_text(system: Any) -> str | None:
    if system is None or system == "":
        return None
    if isinstance(system, str):
        return system
    parts = [
        b["text"]
        for b in system
        if b.get("type") == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)
    ]
    return "".join(parts) if parts else None


def _inline_system_text(message: dict[str, Any]) -> str | None:
    content = message.get("content")
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    return _system_text(content)


def _convert_messages(
    body: dict[str, Any], system: str | None, merge_inline: bool
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system_parts = [system] if system else []
    if merge_inline:
        for message in body["messages"]:
            if message["role"] == "system" and (text := _inline_system_text(message)):
                system_parts.append(text)
    if system_parts:
        out.append({"role": "system", "content": "".join(system_parts)})
    for message in body["messages"]:
        role = message["role"]
        if role == "system":
            if not merge_inline and (text := _inline_system_text(message)):
                out.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": role}
        content = message["content"]
        if isinstance(content, str):
            converted["content"] = content
        else:
            _convert_blocks(content, role, converted, out)
        if not (role == "user" and "content" not in converted):
            out.append(converted)
    return out


def _convert_blocks(
    blocks: list[dict[str, Any]], role: str, converted: dict[str, Any], out: list[dict[str, Any]]
) -> None:
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            tool_calls.append(
                {
                    # vLLM's fallback id is the clock's; a client always sends one.
                    "id": block.get("id") or "call_0",
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result":
            if role == "user":
                out.extend(_user_tool_result(block))  # before the message that holds it
            else:
                result = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {result or ''}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if tool_calls:
        converted["tool_calls"] = tool_calls
    if parts:
        if len(parts) == 1 and parts[0]["type"] == "text":
            converted["content"] = parts[0]["text"]
        else:
            converted["content"] = parts


def _user_tool_result(block: dict[str, Any]) -> list[dict[str, Any]]:
    content = block.get("content")
    call_id = block.get("tool_use_id") or ""
    text = ""
    images: list[str] = []
    references: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(str(item.get("text", "")))
            elif kind == "image":
                url = _image_url(item.get("source") or {})
                if url:
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    messages: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": text}]
    if images:
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        messages.append({"role": "user", "content": parts})
    if references:
        messages.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return messages


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _resolved_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools in effect at the conversation's end (tool_addition / tool_removal applied)."""
    changes = [
        block
        for message in body["messages"]
        if not isinstance(message["content"], str)
        for block in message["content"]
        if block["type"] in ("tool_addition", "tool_removal")
    ]
    tools = body.get("tools")
    if not changes:
        return tools
    by_name = {tool["name"]: tool for tool in tools or []}
    removed: set[str] = set()
    for block in changes:
        change = block.get("tool")
        if not isinstance(change, dict):
            raise AgentRequestError(f"'{block['type']}' needs a 'tool'.", "messages")
        definition = change.get("definition")
        if isinstance(definition, dict) and isinstance(definition.get("name"), str):
            name = definition["name"]
            by_name[name] = definition
        else:
            name = change.get("name")
            if name not in by_name:
                raise AgentRequestError(
                    f"{shown(block['type'])} references tool {shown(name)}, which is not declared "
                    "in tools",
                    "messages",
                )
            if block["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in by_name.items() if name not in removed]


# -- OpenAI Responses --------------------------------------------------------------------


def check_responses_request(body: Any) -> dict[str, Any]:
    """The body of /v1/responses, checked as vLLM's request model checks it (the router
    also needs ``model``: it routes by it)."""
    if not isinstance(body, dict):
        raise AgentRequestError("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise AgentRequestError("'model' is required and must be a non-empty string.", "model")
    items = body.get("input")
    if not isinstance(items, (str, list)):
        raise AgentRequestError("'input' is required: a string or a list of items.", "input")
    if isinstance(items, list):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise AgentRequestError(f"'input[{i}]' must be an object.", f"input[{i}]")
    for key in ("instructions", "previous_response_id"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise AgentRequestError(f"'{key}' must be a string.", key)
    limit = body.get("max_output_tokens")
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise AgentRequestError(
            "'max_output_tokens' must be a positive integer.", "max_output_tokens"
        )
    for key in ("stream", "store", "background"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise AgentRequestError(f"'{key}' must be a boolean.", key)
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise AgentRequestError("'tools' must be a list of objects.", "tools")
    if body.get("prompt") is not None:
        raise AgentRequestError("prompt template is not supported", "prompt")
    for key in ("reasoning", "metadata", "chat_template_kwargs", "text"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise AgentRequestError(f"'{key}' must be an object.", key)
    return body


def responses_to_chat(body: dict[str, Any]) -> ChatConversion:
    """A checked Responses body (without ``previous_response_id``: that history lives on
    the replica) as vLLM's conversion builds the chat conversation."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    else:
        for i, item in enumerate(items):
            message = _item_message(item, messages[-1] if messages else None, f"input[{i}]")
            if message is not None:
                messages.append(message)
    continue_final = _continues_final(items)
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    return ChatConversion(
        messages,
        None,
        _responses_tools(body.get("tools")),
        effort if isinstance(effort, str) else None,
        body.get("chat_template_kwargs"),
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
        # vLLM tokenizes a Responses prompt with the tokenizer's special tokens (chat does not).
        add_special_tokens=True,
    )


def _continues_final(items: str | list[dict[str, Any]]) -> bool:
    if isinstance(items, str) or not items:
        return False
    last = items[-1]
    if last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in ("in_progress", "incomplete")


def _item_message(
    item: dict[str, Any], previous: dict[str, Any] | None, where: str
) -> dict[str, Any] | None:
    """One input item as vLLM's ``_construct_message_from_response_item``: a new message, or
    None when it was merged into the previous assistant message."""
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    kind = item.get("type")
    call: dict[str, Any] | None = None
    if kind == "function_call":
        name = _str(item, "name", where)
        namespace = item.get("namespace")
        if namespace:
            name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
        arguments = _str(item, "arguments", where)
        call = {"id": _str(item, "call_id", where), "type": "function",
                "function": {"name": name, "arguments": arguments}}  # fmt: skip
    elif kind == "custom_tool_call":
        payload = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
        call = {"id": _str(item, "call_id", where), "type": "function",
                "function": {"name": _str(item, "name", where), "arguments": payload}}  # fmt: skip
    if call is not None:
        if assistant is not None:
            calls = assistant.get("tool_calls")
            if calls is None:
                assistant["tool_calls"] = [call]
                return None
            if isinstance(calls, list):
                calls.append(call)
                return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise AgentRequestError("Encrypted content is not supported.", "input")
        text = ""
        content, summary = item.get("content"), item.get("summary")
        if isinstance(content, list) and content and isinstance(content[0], dict):
            text = str(content[0].get("text", ""))
        elif isinstance(summary, list) and summary and isinstance(summary[0], dict):
            text = str(summary[0].get("text", ""))
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        _check_texts(output, f"{where}.output")
        return {"role": "tool", "content": output, "tool_call_id": item.get("call_id")}
    role = item.get("role")
    if role == "assistant":
        content = item.get("content")
        said: Any = None
        if isinstance(content, str):
            said = content
        elif isinstance(content, list) and content and isinstance(content[0], dict):
            said = content[0].get("text")
        if said is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = said
                return None
            return {"role": "assistant", "content": said}
    if role is not None:
        if not isinstance(role, str):
            raise AgentRequestError(f"'{where}.role' must be a string.", f"{where}.role")
        _check_texts(item.get("content"), f"{where}.content")
        return item
    raise AgentRequestError(f"Unsupported input item type: {shown(kind, quote=False)}", "input")


def _check_texts(content: Any, where: str) -> None:
    """A content part's ``text`` is a string (vLLM's part models refuse anything else)."""
    if not isinstance(content, list):
        return
    for i, part in enumerate(content):
        if isinstance(part, dict) and "text" in part and not isinstance(part["text"], str):
            raise AgentRequestError(f"'{where}[{i}].text' must be a string.", f"{where}[{i}].text")


def _responses_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The function tools the template is shown, as vLLM lists them (built-in tools never)."""
    if not tools:
        return None
    shown: list[dict[str, Any]] = []
    for tool in tools:
        kind = tool.get("type")
        if kind == "function":
            shown.append(_chat_tool(tool))
        elif kind == "namespace":
            for inner in tool.get("tools") or []:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    name = f"{tool.get('name')}{NAMESPACE_SEPARATOR}{inner.get('name')}"
                    shown.append(_chat_tool({**inner, "name": name}))
        elif kind == "custom":
            shim = {"name": tool.get("name"), "description": tool.get("description"),
                    "parameters": CUSTOM_TOOL_PARAMETERS}  # fmt: skip
            shown.append(_chat_tool(shim))
    return shown


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
    }
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise AgentRequestError(
            f"'{where}.{key}' is required and must be a string.", f"{where}.{key}"
        )
    return value


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def needs_system_first(chat_template: str | None) -> bool:
    """Whether vLLM merges inline system messages into the first for this template: it
    renders [system, user, system, user] in a sandbox once and merges if that raises."""
    if not chat_template:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    turns = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
    try:
        env.from_string(chat_template).render(messages=turns, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False
