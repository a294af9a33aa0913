"""The error every HTTP route answers with: a status, a message, and OpenAI's fields.

    raise APIError(400, '"top_p" must be in (0, 1]', param="top_p")
    e.body()                      # OpenAI's shape: {"error": {"message", "type", "param", "code"}}
    e.renamed({"stop": "stop_sequences"})   # in a translated API's field names

The route wrapper (`server.app.create_app`) turns one into its JSON answer, in OpenAI's shape or
the API's own (Anthropic's, `server.messages_api.error_body`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def renamed(self, names: Mapping[str, str]) -> APIError:
        """This error (a chat parse's, of a request an API translated into a chat) in that
        API's field names: each quoted name in the message, and the param."""
        message = self.message
        for name, theirs in names.items():
            message = message.replace(f'"{name}"', f'"{theirs}"')
        return APIError(self.status, message, type=self.type, param=names.get(self.param, self.param),
                        code=self.code, headers=self.headers)
