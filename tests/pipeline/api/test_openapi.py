"""The OpenAPI document is generated from the protocol types, agrees with them, and is served."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.api.openapi import ROUTES, openapi_document
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from pipeline.protocol.request_bodies import ChatCompletionRequest, CompletionRequest
from tests.openapi_strategies import from_schema

COMPONENTS = openapi_document()["components"]["schemas"]
_, COMPLETION = msgspec.json.schema_components([CompletionRequest], ref_template="#/components/schemas/{name}")


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(body=from_schema(COMPONENTS["ChatCompletionRequest"], COMPONENTS))
def test_every_body_the_schema_allows_decodes_as_the_type(body: dict[str, Any]) -> None:
    # the schema is msgspec's own view of the type: what it allows, the decoder accepts
    msgspec.json.decode(json.dumps(body).encode(), type=ChatCompletionRequest)


@settings(max_examples=50, derandomize=True, database=None, deadline=None)
@given(prompt=from_schema(COMPLETION["CompletionRequest"]["properties"]["prompt"], COMPLETION) | st.just([[1, 2], [3]]))
def test_completion_prompts_of_every_shape_decode(prompt: Any) -> None:
    assert msgspec.convert({"prompt": prompt}, CompletionRequest).prompt == prompt


def test_every_route_served_is_documented() -> None:
    app = create_app(Pipeline())  # not started: only the routes are read
    served = {
        (route.method.lower(), route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }
    document = openapi_document()
    assert served == {(method, path) for path, ops in document["paths"].items() for method in ops}
    assert served == {(r.method, r.path) for r in ROUTES}
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert chat["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"
    }
