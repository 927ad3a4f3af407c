"""The routing key of a request: model plus the leading text of its prompt.

Requests that share a system prompt (chat) or a prompt prefix (completions) get
the same key, so consistent hashing sends them to the engine that already has
those tokens in its prefix cache.
"""

from __future__ import annotations


def message_text(message: dict) -> str:
    """A chat message's text: its content string, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        # Any shape may arrive here (the engine validates it later): strings only.
        texts = (p.get("text") for p in content if isinstance(p, dict))
        return "".join(t for t in texts if isinstance(t, str))
    return ""


def prefix_key(body, max_chars: int = 100) -> str:
    """Model + the first ``max_chars`` characters of the system message(s) and the
    first user message (chat), or of the prompt (completions)."""
    if not isinstance(body, dict):
        return ""
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    messages = body.get("messages")
    if isinstance(messages, list):
        dicts = [m for m in messages if isinstance(m, dict)]
        system = "".join(message_text(m) for m in dicts if m.get("role") in ("system", "developer"))
        first_user = next((message_text(m) for m in dicts if m.get("role") == "user"), "")
        text = system + "\n" + first_user
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: route by the first
        if isinstance(prompt, list):  # token ids: a comparable number of tokens
            text = ",".join(str(t) for t in prompt[: max(1, max_chars // 4)])
        else:
            text = prompt if isinstance(prompt, str) else ""
    return f"{model}\x00{text[:max_chars]}"
