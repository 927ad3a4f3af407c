"""POST /v1/chat/completions: messages rendered with the model's chat template, tools
(tool_calls.py) shown to the model and, when named or required, enforced."""

from __future__ import annotations

from aiohttp import web

from llmserve.entrypoints.llm import render_chat
from llmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ParsedRequest,
    bad_request,
    parse_chat,
)
from llmserve.entrypoints.openai.serving_engine import (
    accept_generation,
    compile_constraint,
    respond,
)
from llmserve.entrypoints.openai.tool_calls import (
    ToolChoice,
    ToolError,
    messages_for_template,
    parse_tool_choice,
)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine, model, req, parsed = await accept_generation(request, parse_chat)
    tools = parse_tools(req, parsed)
    messages, template_args = messages_for_template(req.template_messages(), tools,
                                                    engine.tokenizer)
    text = render(engine.tokenizer, messages, **template_args)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    await compile_constraint(engine, parsed,
                             "tools" if tools and tools.constrained else "response_format")
    return await respond(request, model, parsed, [text], [ids], chat=True)


def render(tokenizer, messages: list[dict], **template_args) -> str:
    try:
        return render_chat(tokenizer, messages, **template_args)
    except Exception as e:  # noqa: BLE001 - template errors are the request's fault
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from e


def parse_tools(req: ChatCompletionRequest, parsed: ParsedRequest) -> ToolChoice | None:
    """tools / tool_choice; a named or required choice becomes the output constraint."""
    try:
        tools = parse_tool_choice(req.model_dump(include={"tools", "tool_choice"},
                                                 exclude_unset=True))
    except ToolError as e:
        raise bad_request(str(e), e.param) from e
    if tools is not None and tools.constrained:
        if parsed.params.structured_outputs is not None:
            raise bad_request("a named or 'required' tool_choice already constrains the "
                              "output; drop response_format / structured_outputs",
                              "tool_choice")
        try:
            parsed.params.structured_outputs = tools.constraint()
        except ValueError as e:
            raise bad_request(str(e), "tools") from e
    parsed.tools = tools if tools is not None and tools.mode != "none" else None
    return tools
