"""Structured outputs (`response_format` json_object / json_schema) through xgrammar's token mask.

On a tiny random Llama with a small byte-level BPE tokenizer of its own (fewer tokens than the model's vocabulary, so
the mask is padded): greedy output equals transformers' greedy under the same grammar, sampled output parses and
validates, free requests batched with grammar requests get the tokens they get alone, and bad schemas are refused.
On the real default model: the official openai client's `response_format` and `parse` through the HTTP server, and
through the router with one emulated engine process."""
from __future__ import annotations

import json
import shutil

import openai
import pydantic
import pytest

from conftest import openai_client, serving_fleet
import torch

from engine import LLM, SamplingParams
from engine.api_server import ServerThread, build_app
from engine.engine import InvalidRequestError
from engine.engine_backend import EngineBackend
from engine.structured_output import JSON_OBJECT, JSON_SCHEMA, Grammars, StructuredOutput

# Every string bounded, so a random model's document ends within a few dozen tokens. The tag is a pattern, not just
# a maxLength: xgrammar's JSON strings admit UTF-8-encoded surrogates, which a random model finds and which decode
# to U+FFFD.
BOUNDED = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "flag": {"type": "boolean"}, "tag": {"type": "string", "pattern": "^[a-z ,.]{0,4}$", "maxLength": 4}},
    "required": ["color", "count", "flag", "tag"]}
PROMPTS = [[5, 9, 14, 2], [40, 41, 42, 43, 44, 45], [100, 7]]


def schema_of(schema: dict) -> StructuredOutput:
    return StructuredOutput(JSON_SCHEMA, json.dumps(schema))


def validate(value, schema: dict, path: str = "$") -> None:
    """The JSON Schema keywords the tests use: type, enum, properties, required, additionalProperties, items,
    minimum, maximum, maxLength."""
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: {value!r} is not an integer"
    elif kind == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{path}: {value!r} is not a number"
    elif kind is not None:
        assert isinstance(value, kinds[kind]), f"{path}: {value!r} is not of type {kind}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} is not one of {schema['enum']}"
    if "minimum" in schema:
        assert value >= schema["minimum"], f"{path}: {value} < {schema['minimum']}"
    if "maximum" in schema:
        assert value <= schema["maximum"], f"{path}: {value} > {schema['maximum']}"
    if "maxLength" in schema:
        assert len(value) <= schema["maxLength"], f"{path}: {value!r} is longer than {schema['maxLength']}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        missing = set(schema.get("required", [])) - set(value)
        assert not missing, f"{path}: missing {sorted(missing)}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: unexpected keys {sorted(set(value) - set(props))}"
        for key, sub in value.items():
            if key in props:
                validate(sub, props[key], f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{path}[{i}]")


# ---- a tiny random model with a tokenizer -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_json(llama_tiny, tmp_path_factory):
    """(folder, transformers model, tokenizer): the tiny Llama (307 logits) with a byte-level BPE tokenizer of 292
    tokens trained on a little JSON, "</s>" its end of sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    src, hf_model = llama_tiny
    folder = tmp_path_factory.mktemp("llama-json") / "model"
    shutil.copytree(src, folder)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ['{"color": "red", "count": 12, "flag": true, "tag": "abc"}', '{"name": "John", "age": 30}'] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=292, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 0, "bos_token_id": None}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) < hf_model.config.vocab_size
    return str(folder), hf_model, tokenizer


@pytest.fixture(scope="module")
def tiny_llm(tiny_json):
    return LLM(tiny_json[0], max_model_len=256, num_kv_blocks=64)


def transformers_greedy_under_grammar(hf_model, tokenizer, prompt: list[int], spec: StructuredOutput,
                                      max_tokens: int) -> list[int]:
    """The reference: transformers' logits on the whole sequence, the tokens the grammar forbids (read bit by bit
    from xgrammar's bitmask) set to -inf, argmax; until end of sequence."""
    import xgrammar as xgr

    vocab = hf_model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(spec.schema, any_whitespace=False))
    ids, out = list(prompt), []
    while len(out) < max_tokens:
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(bitmask)
        allowed = [bool((int(bitmask[0, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
        token = int(logits.masked_fill(~torch.tensor(allowed), float("-inf")).argmax())
        assert matcher.accept_token(token)
        ids.append(token)
        out.append(token)
        if token == tokenizer.eos_token_id:
            break
    return out


def test_greedy_json_schema_equals_transformers_under_the_same_grammar(tiny_json, tiny_llm):
    hf_model, tokenizer = tiny_json[1], tiny_json[2]
    spec = schema_of(BOUNDED)
    outs = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=80, structured_output=spec))
    for prompt, out in zip(PROMPTS, outs):
        assert out.finish_reason == "stop" and out.token_ids[-1] == tokenizer.eos_token_id
        assert out.token_ids == transformers_greedy_under_grammar(hf_model, tokenizer, prompt, spec, 80)
        validate(json.loads(out.text), BOUNDED)


def test_sampled_json_schema_parses_and_validates(tiny_llm):
    schema = {**BOUNDED, "additionalProperties": False, "properties": {
        **BOUNDED["properties"], "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}
    params = [SamplingParams(temperature=t, top_p=p, seed=seed, max_tokens=120, structured_output=schema_of(schema))
              for seed, (t, p) in enumerate([(1.0, 1.0), (1.3, 1.0), (0.8, 0.9)] * 2)]
    outs = tiny_llm.generate([PROMPTS[i % 3] for i in range(len(params))], params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        validate(json.loads(out.text), schema)
    assert len({out.text for out in outs}) > 1  # sampled, not forced to one document


def test_free_rows_get_the_same_tokens_beside_grammar_rows(tiny_llm):
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=24, ignore_eos=True)]
    alone = [o.token_ids for o in tiny_llm.generate(PROMPTS, free)]
    grammar = [SamplingParams(temperature=t, seed=5, max_tokens=80, structured_output=schema_of(BOUNDED))
               for t in (0.0, 1.0)]
    mixed = tiny_llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[2]],
                              [grammar[0], free[0], free[1], grammar[1], free[2]])
    assert [mixed[1].token_ids, mixed[2].token_ids, mixed[4].token_ids] == alone
    for out in (mixed[0], mixed[3]):
        validate(json.loads(out.text), BOUNDED)
    unconstrained = tiny_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24))[0]
    assert unconstrained.token_ids != mixed[0].token_ids[:24]  # the mask did change the grammar row


def test_bad_schemas_are_refused_and_the_engine_keeps_serving(tiny_llm):
    engine = tiny_llm.engine
    for schema, reason in ([{"type": "objectx"}, 'Unsupported type "objectx"'],
                           [{"type": "string", "pattern": "[a-"}, "Regex"]):
        with pytest.raises(InvalidRequestError, match=reason):
            engine.add_request("bad", PROMPTS[0], SamplingParams(structured_output=schema_of(schema)))
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams(structured_output=StructuredOutput(JSON_SCHEMA, "[1, 2]"))
    with pytest.raises(ValueError, match="not valid JSON"):
        SamplingParams(structured_output=StructuredOutput(JSON_SCHEMA, "{"))
    with pytest.raises(ValueError, match="type must be"):
        SamplingParams(structured_output=StructuredOutput("regex", "a+"))
    assert not engine.has_unfinished() and "bad" not in engine.requests
    out = tiny_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=80,
                                                       structured_output=schema_of(BOUNDED)))[0]
    validate(json.loads(out.text), BOUNDED)


def test_a_model_without_tokenizer_refuses_structured_output(llama_tiny):
    llm = LLM(llama_tiny[0], max_model_len=64, num_kv_blocks=8)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate(PROMPTS[0], SamplingParams(structured_output=StructuredOutput(JSON_OBJECT)))


def test_each_distinct_schema_compiles_once_and_the_cache_is_bounded(tiny_json):
    from transformers import AutoTokenizer

    grammars = Grammars(AutoTokenizer.from_pretrained(tiny_json[0]), 307, [0], capacity=2)
    specs = [schema_of({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}) for i in range(3)]
    first = grammars.compile(specs[0])
    assert grammars.compile(schema_of(json.loads(specs[0].schema))) is first  # equal text: the same grammar
    second = grammars.compile(specs[1])
    assert grammars.compile(specs[0]) is first  # touched: now the most recent
    grammars.compile(specs[2])  # evicts specs[1], the least recent
    assert grammars.compile(specs[0]) is first
    assert grammars.compile(specs[1]) is not second  # compiled again


# ---- the real model through the HTTP server -------------------------------------------------------------------------
MODEL = "smollm2-test"
NUM_KV_BLOCKS = 64
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "London", "Rome"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, an age and a city."}]


class Person(pydantic.BaseModel):
    name: str
    age: int
    likes_cats: bool


@pytest.fixture(scope="module")
def client(default_model):
    llm = LLM(default_model, max_model_len=512, num_kv_blocks=NUM_KV_BLOCKS, tiers="std:5000:60000")
    with ServerThread(build_app(EngineBackend(llm.engine, MODEL))) as server:
        yield openai_client(server)


def person_format(strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def test_chat_json_schema_through_the_openai_client(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                       response_format=person_format())
    assert r.choices[0].finish_reason == "stop"
    validate(json.loads(r.choices[0].message.content), PERSON)
    sampled = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=1.0, seed=4,
                                             response_format=person_format(strict=False), stream=True)
    validate(json.loads("".join(c.choices[0].delta.content or "" for c in sampled if c.choices)), PERSON)


def test_json_object_gives_an_object(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"}, messages=[
                                           {"role": "user", "content": "Give a JSON object with a key 'ok'."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_take_response_format_too(client):
    r = client.completions.create(model=MODEL, prompt="A person in JSON:", max_tokens=60, temperature=0,
                                  extra_body={"response_format": person_format()})
    assert r.choices[0].finish_reason == "stop"
    validate(json.loads(r.choices[0].text), PERSON)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, max_tokens=60, temperature=0, response_format=Person, messages=[
        {"role": "user", "content": "Describe a person: name, age, and whether they like cats."}])
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


@pytest.mark.parametrize("fmt, reason", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, 'Unsupported type'),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format"),
    ({"type": "yaml"}, "response_format"),
], ids=["unsupported-type", "no-schema", "schema-not-object", "unknown-format"])
def test_bad_response_formats_are_400_naming_the_problem(client, fmt, reason):
    with pytest.raises(openai.BadRequestError, match=reason):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, response_format=fmt)


# ---- through the router ---------------------------------------------------------------------------------------------
def test_router_forwards_response_format_to_its_engine(default_model, offline):
    """One emulated engine process behind the router: the same document as the offline emulated engine (its tokens
    are the nearest the grammar allows), and a bad schema refused with 400 from the worker."""
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"]}
    params = SamplingParams(temperature=0, max_tokens=40, structured_output=schema_of(schema))
    want = offline.chat(ASK, params)[0]
    assert want.finish_reason == "stop"
    validate(json.loads(want.text), schema)
    with serving_fleet([
            "--model", default_model, "--executor", "emulated", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--tiers",
            "std:2000:20000", "--min-instances", "1", "--max-instances", "1", "--idle-pool", "0"]) as (server, backend):
        client = openai_client(server)
        r = client.chat.completions.create(model=backend.model_name, messages=ASK, max_tokens=40, temperature=0,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "c", "schema": schema, "strict": True}})
        assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="Unsupported type"):
            client.chat.completions.create(model=backend.model_name, messages=ASK, max_tokens=4,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "c", "schema": {"type": "objectx"}}})
