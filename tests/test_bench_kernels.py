"""bench.kernels judges the GPU lines right: its SDPA baseline solves the same attention problem as the kernels,
and each verdict compares the right figure with the right goal."""
from __future__ import annotations

import pytest
import torch

from bench.kernels import (GROUP, HEAD_DIM, KV_HEADS, Q_HEADS, TARGET_DECODE_BW, TARGET_PREFILL_MMA, Row,
                           gpu_problems, judge, sdpa_baseline, summary)
from kernels import reference
from kernels.paged_batch import random_paged_batch


@pytest.mark.parametrize("q_lens, contexts, num_decodes", [
    ([1] * 5 + [37], [100, 3, 250, 17, 64, 45], 5),   # mixed, decode contexts differ (padded and masked)
    ([1] * 4, [63] * 4, 4),                            # decode, equal contexts
    ([64], [0], 0),                                    # prefill without a prefix
    ([1] * 3 + [20, 9], [31] * 3 + [40, 7], 3),        # two chunks after the decodes
])
def test_the_sdpa_baseline_computes_the_batch_attention(q_lens, contexts, num_decodes):
    batch = random_paged_batch(q_lens, contexts, Q_HEADS, KV_HEADS, HEAD_DIM, 16, torch.float32, "cpu",
                               poison_unused=False)
    run, exact = sdpa_baseline(batch, num_decodes)
    outputs = run()
    pieces = []
    if num_decodes:
        decode = outputs.pop(0)
        assert decode.shape == (num_decodes, KV_HEADS, GROUP, HEAD_DIM)
        pieces.append(decode.reshape(num_decodes, Q_HEADS, HEAD_DIM))
    pieces += [out[0].transpose(0, 1) for out in outputs]
    torch.testing.assert_close(torch.cat(pieces), reference.paged_attention(*batch.attention_args()),
                               atol=1e-5, rtol=1e-5)
    assert exact == (len(set(contexts[:num_decodes])) <= 1)


def row(kernel, shape, seconds, bw_fraction, mma_fraction, goal=None, sdpa_seconds=None, exact=False, impl="triton"):
    return Row(kernel, impl, shape, seconds, 0.0, 0.0, goal=goal, sdpa_seconds=sdpa_seconds, sdpa_exact=exact,
               derived=dict(time_us=seconds * 1e6, GBps=0.0, TFLOPs=0.0, bw_fraction=bw_fraction,
                            mma_fraction=mma_fraction))


def test_verdicts():
    rows = [
        row("attention-decode", "bs=64 ctx=4k", 1e-4, 0.85, 0.01, ("bw", TARGET_DECODE_BW), 1.2e-4, True),
        row("attention-decode", "bs=128 ctx=4k", 1e-4, 0.75, 0.01, ("bw", TARGET_DECODE_BW), 1.2e-4, True),
        row("attention-decode", "bs=8 ctx=4k", 1e-4, 0.50, 0.01, None, 0.9e-4, True),
        row("attention-decode", "bs=8 ctx=U(1,8k)", 1e-4, 0.50, 0.01, None, 0.5e-4, False),
        row("attention-prefill", "chunk=2048 prefix=0", 1e-3, 0.01, 0.55, ("mma", TARGET_PREFILL_MMA), 2e-3, True),
        row("attention-prefill", "chunk=512 prefix=0", 1e-3, 0.01, 0.30, None, 0.9e-3, True, impl="torch-sdpa"),
    ]
    judge(rows)
    verdicts = [r.verdict for r in rows]
    assert verdicts[0] == "met: 85% of copy BW (goal 80%); met: 1.20x SDPA's speed (goal 1x)"
    assert verdicts[1].startswith("MISSED: 75% of copy BW (goal 80%); met")
    assert verdicts[2] == "MISSED: 0.90x SDPA's speed (goal 1x)"
    assert verdicts[3] == ""  # padded SDPA does more work than the problem: shown, not judged
    assert verdicts[4].startswith("met: 55% of bf16 MMA (goal 50%)")
    assert verdicts[5] == ""  # baselines are not judged


def test_the_gpu_problems_cover_the_targets():
    problems = gpu_problems()
    decode = [p for p in problems if p.kind == "decode"]
    assert sorted({len(p.q_lens) for p in decode}) == [1, 8, 32, 64, 128, 256]
    assert all((p.goal is not None) == (len(p.q_lens) >= 64) for p in decode)
    uniform = [p for p in decode if "U(1,8k)" in p.shape]
    assert len(uniform) == 6 and all(1 <= c + 1 <= 8192 for p in uniform for c in p.contexts)
    prefill = {p.shape: p for p in problems if p.kind == "prefill"}
    assert set(prefill) == {f"chunk={c} prefix={p}" for c in (512, 2048) for p in (0, 4096)}
    assert all((p.goal is not None) == p.shape.startswith("chunk=2048") for p in prefill.values())
    (mixed,) = [p for p in problems if p.kind == "mixed"]
    assert mixed.num_decodes == 64 and mixed.q_lens == [1] * 64 + [512]


def test_the_summary_sets_two_tile_configs_side_by_side():
    def result(config, seconds):
        rows = [row("attention-decode", "bs=64 ctx=4k", seconds, 0.9, 0.0, ("bw", TARGET_DECODE_BW), 1.0, True)]
        judge(rows)
        return dict(device="GPU", gpu=True, attention_config=config, torch="t", triton="t", dtype="bfloat16",
                    ceilings=dict(how="h", copy_GBps=4000.0, matmul_TFLOPs=700.0),
                    rows=[dict(kernel=r.kernel, impl=r.impl, shape=r.shape, seconds=r.seconds, verdict=r.verdict,
                               sdpa_seconds=r.sdpa_seconds, sdpa_exact=r.sdpa_exact, derived=r.derived)
                          for r in rows])

    text = summary(result("pipelined", 1e-4), result("legacy", 2e-4))
    assert "1 of 1 judged lines meet every target" in text
    assert "| attention-decode | bs=64 ctx=4k | 100.0 | 200.0 | pipelined |" in text
    assert "Faster on pipelined: 1 lines, legacy: 0 lines." in text
