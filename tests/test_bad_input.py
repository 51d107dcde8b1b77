"""Bad input is a clear error, and the engine and the other requests carry on."""
from __future__ import annotations

import json

import pytest

from engine import LLM, InvalidRequestError, ModelFolderError, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_tiny):
    return LLM(llama_tiny[0], num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed="x"), "seed"),
])
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt,match", [
    (list(range(1, 200)), "context length"), ([], "empty"), ([1, 2, 10_000], "outside the vocabulary"),
    ("text", "no tokenizer"), ([1.5, 2], "list of token ids"),
])
def test_bad_prompts_fail_alone(llm, prompt, match):
    good = [[1, 2, 3], [4, 5, 6, 7]]
    engine = llm.engine
    engine.add_request("good-0", good[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=5))
    engine.add_request("good-1", good[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(done) == ["good-0", "good-1"] and all(len(o.token_ids) == 5 for o in done.values())
    assert "bad" not in engine.requests
    assert engine.blocks.num_free_blocks() == engine.blocks.num_total_blocks


def test_duplicate_request_id(llm):
    llm.engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        llm.engine.add_request("dup", [3, 4], SamplingParams(max_tokens=1))
    llm.engine.abort("dup")


def test_bad_prompt_in_generate_leaves_nothing_behind(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 3], []], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished()


def test_unsupported_model_folders(tmp_path, llama_tiny):
    with pytest.raises(ModelFolderError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFolderError, match="config.json is missing"):
        LLM(str(tmp_path / "empty"))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelFolderError, match="unsupported architecture"):
        LLM(str(gpt2))
    src = json.load(open(f"{llama_tiny[0]}/config.json"))
    src.pop("rope_parameters", None)  # the older spelling, rope_scaling + top-level rope_theta, is read too
    for name, change, match in [("noweights", {}, "no \\*.safetensors"),
                                ("wrongshape", {"intermediate_size": 100}, "has shape"),
                                ("badrope", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type")]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**src, **change}))
        if name != "noweights":
            (folder / "model.safetensors").symlink_to(f"{llama_tiny[0]}/model.safetensors")
        with pytest.raises(ModelFolderError, match=match):
            LLM(str(folder))
