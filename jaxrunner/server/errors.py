"""The error every route answers with: OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`, and the messages clients match on (SGLang's wording where SGLang has one)."""

from pydantic import ValidationError


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}

    @classmethod
    def from_validation(cls, e: ValidationError) -> "APIError":
        """Names every bad field and why, e.g. `max_tokens: Input should be a valid integer`."""
        parts, first = [], None
        for err in e.errors(include_url=False):
            loc = ".".join(str(x) for x in err["loc"]) or "body"
            first = first or loc
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            parts.append(f"{loc}: {msg}")
        return cls("invalid request: " + "; ".join(parts), 400, first)


def payload_too_large(size: int, limit: int) -> APIError:
    """413 for a body past --max-payload-size."""
    return APIError(f"Request body too large: {size} bytes, more than the server's limit of "
                    f"{limit} bytes (--max-payload-size)", 413)
