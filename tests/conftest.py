"""Shared fixtures: tiny random checkpoints of every supported layout, and the real default model."""
from __future__ import annotations

import contextlib
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
try:
    import torch

    if not torch.cuda.is_available():
        # Triton kernels run on CPU tensors through the interpreter; it must be chosen before triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

import pytest

TINY = dict(vocab_size=307, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=1024)
# name -> (transformers config class, extra fields)
TINY_MODELS = {
    "llama-gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-tied-mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-odd-heads": ("LlamaConfig", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48,
                                            vocab_size=263, tie_word_embeddings=False)),
    "llama31-rope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64), rope_theta=500000.0)),
    "qwen2-bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
}


def make_tiny_checkpoint(folder, name: str, seed: int = 0):
    """A random model of the given layout saved as a Hugging Face folder; returns the transformers model."""
    import transformers

    cls_name, extra = TINY_MODELS[name]
    cfg = getattr(transformers, cls_name)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if "bias" in name:  # random biases, so a missed bias shows in the output
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session", params=sorted(TINY_MODELS))
def tiny_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return str(folder), make_tiny_checkpoint(folder, request.param)


@pytest.fixture(scope="session")
def llama_tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-gqa")
    return str(folder), make_tiny_checkpoint(folder, "llama-gqa")


@pytest.fixture(scope="session")
def default_model():
    from engine.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def offline(request, default_model):
    """The default model on an offline emulated engine that steps at once, with the test module's `NUM_KV_BLOCKS`:
    the greedy texts a served fleet of the same engines must return."""
    from engine import LLM

    return LLM(default_model, executor="emulated", num_kv_blocks=request.module.NUM_KV_BLOCKS,
               step_time=lambda *_: 0.0)


def openai_client(server):
    """The official openai client of a server (anything with a `url`): no retries, so a refusal reaches the test."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def completion_text(server, stream: bool, max_tokens: int, **kwargs) -> str:
    """A completion's text through the openai client, streamed or whole, checked to have run its `max_tokens` to
    their end ("length")."""
    client = openai_client(server)
    if stream:
        chunks = list(client.completions.create(stream=True, max_tokens=max_tokens, **kwargs))
        assert chunks[-1].choices[0].finish_reason == "length"
        return "".join(c.choices[0].text for c in chunks if c.choices)
    out = client.completions.create(max_tokens=max_tokens, **kwargs)
    assert out.usage.completion_tokens == max_tokens and out.choices[0].finish_reason == "length"
    return out.choices[0].text


@pytest.fixture(scope="session")
def h200_fleet():
    """The H200 profile of Llama-3.1-8B, its default tiers, and workloads of the conversation trace for a fleet of
    the simulator's default deployment."""
    from cluster.sim.simulator import SimConfig
    from cluster.sim.workload import WorkloadFactory, default_tiers, load_trace
    from scheduler.build_profiles import PROFILE_DIR
    from scheduler.profile_table import ProfileTable

    model = ProfileTable.load(PROFILE_DIR / "llama-3.1-8b_h200.json")
    tiers = default_tiers(model)
    cfg = SimConfig(num_instances=4)
    factory = WorkloadFactory(load_trace("azure2023_conv"), tiers, model, cfg.kv_blocks * cfg.block_size,
                              cfg.max_prefill_chunk)
    return model, tiers, factory


@contextlib.contextmanager
def serving_fleet(argv: list[str], timeout_s: float = 90.0):
    """`python -m cluster.serve argv` in this process, on a server thread: (server, backend) once an engine serves."""
    from cluster.serve import build_backend, parse_args
    from engine.api_server import ServerThread, build_app

    backend = build_backend(parse_args(argv))
    with ServerThread(build_app(backend)) as server:
        deadline = time.monotonic() + timeout_s
        while not backend.ready:
            assert time.monotonic() < deadline, "the engine process did not come up"
            time.sleep(0.05)
        yield server, backend
