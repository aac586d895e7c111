"""What both engines' HTTP surfaces share: the model list and the checks of a chat-completions body."""

from typing import Any

from fastapi import HTTPException, Request


def model_list(model_id: str, adapters: Any) -> dict[str, Any]:
    """``GET /v1/models``: the base model, then each adapter with the base as its parent."""
    data = [{"id": model_id, "object": "model", "owned_by": "stam"}]
    data += [{"id": name, "object": "model", "owned_by": "stam", "parent": model_id} for name in sorted(adapters)]
    return {"object": "list", "data": data}


async def chat_body(request: Request) -> dict[str, Any]:
    """The request's JSON object with a non-empty ``messages`` list, else HTTP 400 saying what is wrong."""
    try:
        body = await request.json()
    except ValueError as exc:
        raise HTTPException(status_code=400, detail=f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise HTTPException(status_code=400, detail="body must be a JSON object")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise HTTPException(status_code=400, detail="messages must be a non-empty list")
    return body
