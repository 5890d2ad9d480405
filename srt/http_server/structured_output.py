"""Request fields of structured output, shared by the OpenAI and the native request models.

OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `name`, `schema`, `strict`) and SGLang's
`json_schema` (JSON text), `regex` and `ebnf` (GBNF) extras. Shapes and sizes are checked here (a schema must
be a JSON object); whether the constraint compiles is checked by the TokenizerManager with the server's
grammar backend before the request is queued. Both failures are a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from srt.constrained.base_backend import JSON_OBJECT_SCHEMA
from srt.constrained.satisfiable import check_json_nesting
from srt.http_server.request_types import FieldError, StrictModel

# Longest constraint text (a schema as JSON, a regex, a grammar): compiling is superlinear in its size, and a
# schema a model can follow fits well inside this.
MAX_GRAMMAR_CHARS = 64 * 1024
# OpenAI's rule for response_format.json_schema.name.
SCHEMA_NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf")


def _schema_text(value: str) -> str:
    check_json_nesting(value)  # before parsing: Python's json raises RecursionError (a 500) near 1,000 deep
    try:
        schema = json.loads(value)
    except ValueError as e:
        raise ValueError(f"must be a JSON schema as JSON text: {e}") from e
    if not isinstance(schema, dict):
        raise ValueError("must be a JSON schema: a JSON object")
    return value


GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
SchemaText = Annotated[GrammarText, AfterValidator(_schema_text)]


def _schema_object(value: dict[str, Any]) -> dict[str, Any]:
    if len(json.dumps(value)) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the schema must have at most {MAX_GRAMMAR_CHARS} characters as JSON")
    return value


class JsonSchemaFormat(StrictModel):
    name: Annotated[str, AfterValidator(lambda v: _check_name(v))]
    description: str | None = None
    schema_: Annotated[dict[str, Any], AfterValidator(_schema_object)] | None = Field(None, alias="schema")
    strict: bool | None = None


def _check_name(name: str) -> str:
    if not SCHEMA_NAME_PATTERN.fullmatch(name):
        raise ValueError("must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    return name


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError(
                "`response_format.json_schema` is required with type json_schema", "response_format"
            )
        return self

    def schema_text(self) -> str | None:
        """The constraint as JSON-schema text, or None for `text`. Without a schema, any JSON object."""
        if self.type == "text":
            return None
        if self.json_schema is not None and self.json_schema.schema_ is not None:
            return json.dumps(self.json_schema.schema_)
        return JSON_OBJECT_SCHEMA


class ConstraintFields(StrictModel):
    """SGLang's constraint fields; at most one of them (and of `response_format`) per request."""

    json_schema: SchemaText | None = None
    regex: GrammarText | None = None
    ebnf: GrammarText | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> ConstraintFields:
        self.constraint()
        return self

    def constraint(self) -> dict[str, str]:
        """The SamplingParams fields of the request's constraint ({} when unconstrained); raises, naming the
        second field, when more than one is given."""
        response_format: ResponseFormat | None = getattr(self, "response_format", None)
        given = {name: getattr(self, name) for name in CONSTRAINT_FIELDS if getattr(self, name) is not None}
        schema = response_format.schema_text() if response_format is not None else None
        if schema is not None:
            if given:
                raise FieldError(
                    f"`response_format` cannot be combined with `{next(iter(given))}`: send one constraint",
                    "response_format",
                )
            return {"json_schema": schema}
        if len(given) > 1:
            second = list(given)[1]
            raise FieldError(
                f"send at most one of {', '.join(CONSTRAINT_FIELDS)}; got {' and '.join(given)}",
                second,
            )
        return given

    @property
    def schema_param(self) -> str:
        """The field a JSON-schema constraint came from, for an error to name: `response_format` where it
        was given (it wins over nothing else: `constraint` refuses two), else SGLang's `json_schema`."""
        response_format = getattr(self, "response_format", None)
        if response_format is not None and response_format.type != "text":
            return "response_format"
        return "json_schema"


class OpenAIConstraintFields(ConstraintFields):
    """The OpenAI routes' constraints: `response_format` and SGLang's extras in the body."""

    response_format: ResponseFormat | None = None
