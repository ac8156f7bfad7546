"""A real trained model, SmolLM2-135M-Instruct, served from its GGUF file through the HTTP server and
the ``openai`` client, with plain-string content as clients send it: greedy answers are transformers'
own greedy ``generate``, token for token; JSON-schema answers are valid and carry the prompt's facts;
a streamed answer is the whole one.

One server for the module: the model loads once (about 540 MB in fp32), each test asks a few dozen
greedy tokens on the CPU.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import jsonschema
import openai
import pytest
import torch

from pipeline import PipelineConfig
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.models.real_model import smollm2_gguf
from tests.servers import serving
from vision.checkpoint import Checkpoint

MAX_TOKENS = 40
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a short poem about the sea.",  # its answer ends at max_tokens
]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
# (sentence, the facts the answer must carry)
EXTRACTIONS = [
    ("Maria Lopez is 34 years old and lives in Madrid.", {"name": "Maria Lopez", "age": 34, "city": "Madrid"}),
    ("John Smith, aged 52, works as a teacher in Chicago.", {"name": "John Smith", "age": 52, "city": "Chicago"}),
]

Served = tuple[Pipeline, openai.AsyncOpenAI]


def chat(question: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def reference(smollm2: Checkpoint) -> Any:
    """transformers' own model of the same folder, in fp32 as the server runs it on the CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32).eval()


def greedy(reference: Any, tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """transformers' greedy ``generate`` on ``apply_chat_template(..., add_generation_prompt=True)``."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = reference.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return list(out[0, inputs["input_ids"].shape[1] :].tolist())


@pytest.fixture(scope="module")
async def served(smollm2: Checkpoint) -> AsyncIterator[Served]:
    # the model named as a user names it: the GGUF file, which resolves to the converted folder
    config = PipelineConfig(
        model=str(smollm2_gguf()),
        device="cpu",
        max_running_seqs=4,
        num_kv_blocks=128,  # 2,048 tokens of KV: 47 MB in fp32 for 30 layers
        max_model_len=1024,
        preparation_mode="thread",
        engine_mode="thread",
    )
    with anyio.fail_after(180):
        async with Pipeline(config) as pipe:
            assert pipe.checkpoint.path == smollm2.path
            async with serving(create_app(pipe)) as base:
                client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
                try:
                    yield pipe, client
                finally:
                    await client.close()


def test_the_gguf_file_is_the_checkpoint_it_converts_to(smollm2: Checkpoint) -> None:
    """The folder holds what transformers reads from the file: the Llama config, the tokenizer with its
    ChatML template, and the embedding table dequantized by gguf itself."""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(smollm2_gguf())
    assert smollm2.model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert smollm2.config.architectures == ["LlamaForCausalLM"] and smollm2.text_config.num_hidden_layers == 30
    template = reader.get_field("tokenizer.chat_template")
    assert template is not None and smollm2.tokenizer.chat_template == template.contents()
    tokens = reader.get_field("tokenizer.ggml.tokens")
    assert tokens is not None and smollm2.tokenizer.convert_ids_to_tokens(list(range(100))) == tokens.contents()[:100]
    assert smollm2.tokenizer.convert_ids_to_tokens(smollm2.stop_token_ids) == ["<|im_end|>"]
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    rows = torch.from_numpy(gguf.dequantize(embedding.data[:1024], embedding.tensor_type).copy())
    with safe_open(str(smollm2.path / "model.safetensors"), framework="pt") as weights:
        assert torch.equal(weights.get_slice("model.embed_tokens.weight")[:1024], rows)


@pytest.mark.parametrize("question", QUESTIONS)
async def test_a_greedy_chat_answer_is_transformers_own(
    question: str, served: Served, reference: Any, smollm2: Checkpoint
) -> None:
    pipe, client = served
    expected = greedy(reference, smollm2.tokenizer, chat(question))
    reply = await client.chat.completions.create(
        model=pipe.model_name, messages=chat(question), max_tokens=MAX_TOKENS, temperature=0, logprobs=True
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    served_bytes = [bytes(entry.bytes or []) for entry in logprobs.content]
    assert len(served_bytes) >= len(expected) - 1  # every token but an ending eos
    assert served_bytes == [pipe.token_table[t] for t in expected[: len(served_bytes)]]
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected)
    assert reply.choices[0].message.content == smollm2.tokenizer.decode(expected, skip_special_tokens=True)


async def test_a_completion_of_the_rendered_prompt_is_transformers_own(
    served: Served, reference: Any, smollm2: Checkpoint
) -> None:
    """/v1/completions on the prompt the client renders itself: the model and the engine alone, apart
    from the server's chat template."""
    pipe, client = served
    question = QUESTIONS[0]
    expected = greedy(reference, smollm2.tokenizer, chat(question))
    prompt = smollm2.tokenizer.apply_chat_template(chat(question), add_generation_prompt=True, tokenize=False)
    reply = await client.completions.create(model=pipe.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected)
    assert reply.choices[0].text == smollm2.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize(("sentence", "facts"), EXTRACTIONS)
async def test_a_json_schema_answer_carries_the_facts_of_the_prompt(
    sentence: str, facts: dict[str, Any], served: Served
) -> None:
    pipe, client = served
    question = f"Extract the person's name, age and city from this sentence as JSON.\n\n{sentence}"
    reply = await client.chat.completions.create(
        model=pipe.model_name,
        messages=chat(question),
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert reply.choices[0].finish_reason == "stop"
    answer = json.loads(reply.choices[0].message.content or "")
    jsonschema.validate(answer, PERSON)
    assert answer == facts


async def test_a_streamed_answer_is_the_whole_answer(served: Served) -> None:
    pipe, client = served
    request: dict[str, Any] = {
        "model": pipe.model_name,
        "messages": chat(QUESTIONS[1]),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    whole = await client.chat.completions.create(**request)
    stream = await client.chat.completions.create(**request, stream=True)
    deltas = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert len([d for d in deltas if d]) > 1  # streamed in pieces, not in one
    assert "".join(deltas) == whole.choices[0].message.content
