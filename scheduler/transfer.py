"""How long a prefill instance's KV takes to reach a decode instance: a request's prompt KV over one link, bytes at
the link's effective bandwidth plus a fixed latency (framing, the pull's round trip, the first chunk's setup).

The presets are nominal, not measured here: effective rates read off the datasheets with the usual loss to protocol
and to gathering scattered KV blocks, for an order of magnitude in the simulator, not a prediction of a deployment.
- same-host: device -> pinned host -> device between two GPUs of one host, each copy over PCIe Gen5 x16 (64 GB/s a
  direction nominal, the H200's host interface), the two hops not fully overlapped;
- nvlink: GPU to GPU over NVLink 4 (NVIDIA H200 SXM datasheet: 900 GB/s both directions together, 450 GB/s one
  way), of which a block-by-block copy of KV gets a third;
- net-400g: one 400 Gb/s NIC (ConnectX-7 / InfiniBand NDR), 50 GB/s line rate, at 80 % of it.
"""
from __future__ import annotations

from dataclasses import dataclass

from scheduler.roofline import LLAMA_3_1_8B, ModelShape


@dataclass(slots=True, frozen=True)
class TransferLink:
    name: str
    bandwidth: float  # effective bytes/s
    latency_s: float  # per transfer, independent of its size

    def __post_init__(self):
        if not (self.bandwidth > 0 and self.latency_s >= 0):
            raise ValueError(f"link {self.name}: bandwidth must be positive and latency non-negative")


LINKS = {link.name: link for link in (
    TransferLink("same-host", bandwidth=25e9, latency_s=10e-6),
    TransferLink("nvlink", bandwidth=150e9, latency_s=5e-6),
    TransferLink("net-400g", bandwidth=40e9, latency_s=20e-6),
)}


def kv_bytes_per_token(model: ModelShape) -> int:
    """K and V of every layer's KV heads for one token (131072 for Llama-3.1-8B in bf16)."""
    return model.num_layers * 2 * model.num_kv_heads * model.head_dim * model.dtype_bytes


@dataclass(slots=True, frozen=True)
class TransferModel:
    """A prompt's KV moved over `link` for a model whose tokens take `bytes_per_token` of KV each."""
    link: TransferLink
    bytes_per_token: int

    def __post_init__(self):
        if self.bytes_per_token < 1:
            raise ValueError(f"bytes_per_token must be positive, got {self.bytes_per_token}")

    def seconds(self, num_tokens: int) -> float:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
        return num_tokens * self.bytes_per_token / self.link.bandwidth + self.link.latency_s


def transfer_model(link: str, model: ModelShape = LLAMA_3_1_8B) -> TransferModel:
    """The preset `link` (a name of LINKS) for `model`'s KV."""
    if link not in LINKS:
        raise ValueError(f"transfer link must be one of {', '.join(LINKS)}, got {link!r}")
    return TransferModel(LINKS[link], kv_bytes_per_token(model))
