"""OpenAI-shaped errors for /v1: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from django.http import JsonResponse

from engine_adapter.types import EngineError

TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
    404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
    429: "rate_limit_error", 500: "server_error", 502: "server_error", 503: "server_error",
    504: "server_error",
}


class GatewayError(Exception):
    """An error to answer in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    @classmethod
    def from_engine(cls, exc: EngineError) -> GatewayError:
        return cls(exc.status, str(exc), code=exc.code, param=getattr(exc, "param", None))

    def response(self, request_id: str | None = None) -> JsonResponse:
        body = {"error": {"message": self.message, "type": TYPE_BY_STATUS.get(self.status,
                          "invalid_request_error"), "param": self.param, "code": self.code}}
        response = JsonResponse(body, status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        if request_id:
            response["x-request-id"] = request_id
        return response


def invalid(message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)
