"""PolyServe's inference engine: paged KV cache, continuous batching with chunked prefill, pluggable executors."""
from engine.config import EngineConfig
from engine.engine import Engine, InvalidRequestError, RequestOutput
from engine.llm import LLM, build_engine
from engine.model_config import ModelConfig, ModelFolderError
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "Engine", "RequestOutput", "InvalidRequestError",
           "ModelConfig", "ModelFolderError", "build_engine"]
