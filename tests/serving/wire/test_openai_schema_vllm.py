"""The request-field table (``serving.wire.fields``) against vLLM's own OpenAI request models.

The table follows one vLLM version; these tests read the installed vLLM's ``CompletionRequest``
and ``ChatCompletionRequest`` so that a vLLM that adds, drops or moves a field fails here, not
in a user's client. Only imports: no engine starts. Where vLLM is not installed, everything
here skips with the reason.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap
from collections.abc import Mapping
from typing import Any

import pytest

from serving.wire import fields

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (the CPU build installs with: nox -s vllm)",
    ),
]

# vLLM extensions that vLLM 0.29 declares among the OpenAI fields of its chat request.
VLLM_FIELDS_IN_THE_OPENAI_BLOCK = frozenset({"thinking_token_budget", "include_reasoning"})


def request_models() -> dict[str, tuple[Any, Mapping[str, fields.Field]]]:
    """vLLM's request model and our table, per endpoint."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {
        "completions": (CompletionRequest, fields.COMPLETION_FIELDS),
        "chat": (ChatCompletionRequest, fields.CHAT_FIELDS),
    }


ENDPOINTS = ("completions", "chat")


def openai_block(model: type) -> set[str]:
    """The fields vLLM declares before its own parameters (the first ``# --8<-- [start:``
    marker): the block it comments as ordered by OpenAI's API documentation."""
    source = textwrap.dedent(inspect.getsource(model))
    lines = source.splitlines()
    marker = next(n for n, line in enumerate(lines, 1) if "# --8<-- [start:" in line)
    assert any("official OpenAI API" in line for line in lines[:marker]), model.__name__
    (cls,) = ast.parse(source).body
    assert isinstance(cls, ast.ClassDef)
    return {
        node.target.id
        for node in cls.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and node.lineno < marker
    }


def test_the_table_follows_the_installed_vllm_version() -> None:
    import vllm

    assert vllm.__version__ == fields.VLLM_VERSION, (
        f"vLLM is {vllm.__version__}, the field table follows {fields.VLLM_VERSION}: update "
        "serving/wire/fields.py (fields, checks, VLLM_VERSION) from the new request models"
    )


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_table_names_exactly_vllms_request_fields(endpoint: str) -> None:
    model, table = request_models()[endpoint]
    ours, theirs = set(table), set(model.model_fields)
    assert ours == theirs, {"only in vLLM": theirs - ours, "only in the table": ours - theirs}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_openai_flags_are_vllms_openai_block(endpoint: str) -> None:
    model, table = request_models()[endpoint]
    flagged = {name for name, spec in table.items() if spec.openai}
    block = openai_block(model) - VLLM_FIELDS_IN_THE_OPENAI_BLOCK
    assert flagged == block, {"only in vLLM's block": block - flagged, "only ours": flagged - block}


def vllm_defaults(model: Any) -> dict[str, Any]:
    """Each field's default as vLLM declares it; required fields and factories left out."""
    from pydantic_core import PydanticUndefined

    return {
        name: info.default
        for name, info in model.model_fields.items()
        if info.default is not PydanticUndefined and info.default_factory is None
    }


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_vllms_default_values_pass_our_checks(endpoint: str) -> None:
    """A client that sends every field at vLLM's default is answered, not refused."""
    model, table = request_models()[endpoint]
    defaults = vllm_defaults(model)
    assert {"max_tokens", "stop", "n"} <= set(defaults)
    refused = {}
    for name, default in defaults.items():
        try:
            fields.check(table, {name: default})
        except fields.FieldError as exc:
            refused[name] = str(exc)
    assert not refused


def test_the_sampling_fields_are_sampling_params_arguments() -> None:
    """The vllm engine passes ``EngineRequest.sampling`` to SamplingParams as keywords."""
    from vllm import SamplingParams

    unknown = fields.SAMPLING_PARAMS - set(SamplingParams.__struct_fields__)
    assert not unknown, "not SamplingParams arguments"
