"""OpenAI's error object, for every failure the HTTP surface reports.

Clients (the `openai` package among them) parse `{"error": {"message", "type", "param", "code"}}`; a bare
FastAPI `{"detail": ...}` or a 500 with a traceback would surface as an unhelpful generic error.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from srt.http_server.request_types import RefusedKey, StrictModel

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
SERVICE_UNAVAILABLE = "service_unavailable"


class OpenAIError(Exception):
    """An error the HTTP layer turns into OpenAI's error object with `status`."""

    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status)


_VALUE_ERROR_PREFIX = "Value error, "


def _field_path(loc: tuple) -> str:
    """`messages.0.content` from pydantic's location, without the body and the union branch names
    (`str`, `list[int]`, `function-after[...]`) it puts in between."""
    parts = [str(p) for p in loc if isinstance(p, int) or (p != "body" and p.isidentifier())]
    branches = _TYPE_NAMES | _model_names(StrictModel)  # a union's model branch is named by its class
    return ".".join(p for p in parts if p not in branches)


def _model_names(model: type) -> set[str]:
    return {model.__name__}.union(*map(_model_names, model.__subclasses__()))


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "tuple"}
# pydantic's error for a whole body that is not an object (as FastAPI validates it, and as a model does)
_NOT_AN_OBJECT = ("model_attributes_type", "model_type")


def _named_field(error: dict) -> str:
    """The field an error is about: its location, or the field a FieldError names itself (a refused key:
    the key inside the object at the location)."""
    path = _field_path(error.get("loc", ()))
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, RefusedKey) and path:
        return f"{path}.{cause.param}"
    return path or getattr(cause, "param", None) or ""


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """A readable 400 from pydantic's error list: the most specific problem, named by its field path (of
    a union's branches, the one that got furthest into the value)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    if first.get("type") in _NOT_AN_OBJECT and not _field_path(first.get("loc", ())):
        return OpenAIError("the request body must be a JSON object", code="invalid_value")
    named = [(_named_field(e), e) for e in errors]
    field, best = max(named, key=lambda pair: len(pair[0].split(".")) if pair[0] else 0)
    path = _field_path(best.get("loc", ()))
    msg = best.get("msg", "invalid value").removeprefix(_VALUE_ERROR_PREFIX)
    message = f"{path}: {msg}" if path else msg
    others = len({name for name, _ in named} - {field})
    if others:
        message += f" (and {others} more problem(s))"
    return OpenAIError(message, param=field or None, code="invalid_value")


def status_error(status: int, detail: str | None) -> OpenAIError:
    """OpenAI-shaped error for a plain HTTP status (unknown route, wrong method …)."""
    kind = NOT_FOUND if status == HTTPStatus.NOT_FOUND else INVALID_REQUEST
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "error"
    return OpenAIError(detail or phrase, status=status, type=kind)
