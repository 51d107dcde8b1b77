"""The tile-config and kernel-variant sweep run on the H200 on 2026-12-04 (its second version: the working tree's kernel
against the one before the longest-first order, copied to .sweep/attention_mid.py). A record of how the figures in
bench/RESULTS.md were taken, not part of the program."""
import importlib.util, json, os, random, sys, time
import torch
sys.path.insert(0, os.getcwd())
from bench import kernels as bk
from kernels.paged_batch import random_paged_batch
import kernels.attention as new

SMOKE = os.environ.get("SMOKE") == "1"
OUT = os.environ.get("OUT", "/tmp")
spec = importlib.util.spec_from_file_location("attention_mid", ".sweep/attention_mid.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
dev = torch.device("cpu" if SMOKE else "cuda")
timer = bk.cpu_timer(0.01, 3) if SMOKE else bk.cuda_timer(0.04, 100)
t0 = time.time()
if SMOKE:
    copy_bw, mma = 1e9, 1e9
else:
    copy_bw, mma, _ = bk.measure_ceilings(dev, timer)
print(f"ceilings copy {copy_bw/1e9:.0f} GB/s mma {mma/1e12:.1f} TFLOP/s", flush=True)
QH, KH, D, BS = (8, 2, 32, 16) if SMOKE else (32, 8, 128, 16)
dtype = torch.bfloat16
rng = random.Random(0)
def P(name, q_lens, ctx, nd):
    return (name, q_lens, ctx, nd)
if SMOKE:
    prefill_problems = [P("chunk=64 p0", [64], [0], 0), P("mixed", [1] * 2 + [32], [40] * 2 + [16], 2)]
    decode_problems = [P("bs=2 ctx=100", [1] * 2, [99] * 2, 2)]
else:
    prefill_problems = [P("chunk=2048 p0", [2048], [0], 0), P("chunk=2048 p4096", [2048], [4096], 0),
                        P("chunk=512 p0", [512], [0], 0), P("chunk=512 p4096", [512], [4096], 0),
                        P("mixed 64x4k+512@4k", [1] * 64 + [512], [4095] * 64 + [4096], 64)]
    decode_problems = [P("bs=8 4k", [1] * 8, [4095] * 8, 8), P("bs=64 4k", [1] * 64, [4095] * 64, 64),
                       P("bs=64 U", [1] * 64, [rng.randint(1, 8192) - 1 for _ in range(64)], 64),
                       P("bs=128 U", [1] * 128, [rng.randint(1, 8192) - 1 for _ in range(128)], 128),
                       P("bs=256 4k", [1] * 256, [4095] * 256, 256)]
results = []
def run(mod, label, problems, prefill_cfg=None, decode_cfg=None):
    orig = mod._tile_config
    def patched(block_d, group, decode, fp32):
        if decode and decode_cfg: return decode_cfg
        if not decode and prefill_cfg: return prefill_cfg
        return orig(block_d, group, decode, fp32)
    mod._tile_config = patched
    try:
        for name, q_lens, ctx, nd in problems:
            batch = random_paged_batch(q_lens, ctx, QH, KH, D, BS, dtype, dev, poison_unused=False)
            hints = dict(max_query_len=max(q_lens), num_decodes=nd, max_seq_len=max(q + c for q, c in zip(q_lens, ctx)))
            args = batch.attention_args()
            ref = None
            try:
                out = mod.paged_attention(*args, **hints)
                ref = new.paged_attention(*args, **hints) if mod is not new else None
                err = float((out.float() - ref.float()).abs().max()) if ref is not None else 0.0
                sec = timer(lambda: mod.paged_attention(*args, **hints))
                kv = 2 * sum(q + c for q, c in zip(q_lens, ctx)) * KH * D * 2 + 2 * batch.q.numel() * 2
                fl = 4.0 * batch.keys_seen() * QH * D
                row = dict(variant=label, problem=name, prefill_cfg=prefill_cfg, decode_cfg=decode_cfg, us=sec * 1e6,
                           bw=kv / sec / copy_bw, mma=fl / sec / mma, err_vs_new=err)
            except Exception as e:
                row = dict(variant=label, problem=name, prefill_cfg=prefill_cfg, decode_cfg=decode_cfg,
                           error=f"{type(e).__name__}: {str(e)[:200]}")
            results.append(row)
            print(f"{time.time()-t0:6.1f}s {label:4} P{prefill_cfg} D{decode_cfg} {name}: " +
                  (f"{row['us']:.1f} us bw {row['bw']*100:.0f}% mma {row['mma']*100:.1f}% err {row['err_vs_new']:.3g}"
                   if "us" in row else row["error"]), flush=True)
            del batch, args
    finally:
        mod._tile_config = orig
    with open(os.path.join(OUT, "sweep.json"), "w") as f:
        json.dump(results, f, indent=1)
# SDPA references
for name, q_lens, ctx, nd in prefill_problems + decode_problems:
    if SMOKE: break
    batch = random_paged_batch(q_lens, ctx, QH, KH, D, BS, dtype, dev, poison_unused=False)
    fn, exact = bk.sdpa_baseline(batch, nd)
    sec = timer(fn)
    results.append(dict(variant="sdpa", problem=name, us=sec * 1e6, exact=exact))
    print(f"{time.time()-t0:6.1f}s sdpa {name}: {sec*1e6:.1f} us exact={exact}", flush=True)
    del batch, fn
prefill_cfgs = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4)]
decode_cfgs = [(16, 128, 4, 3), (16, 128, 4, 5), (16, 128, 8, 4), (16, 256, 4, 3), (16, 256, 8, 3), (16, 128, 2, 4)]
if SMOKE:
    prefill_cfgs = [(16, 16, 4, 2)]; decode_cfgs = [(16, 16, 4, 2)]
run(old, "mid", prefill_problems)
run(new, "new", prefill_problems + decode_problems)
for cfg in prefill_cfgs:
    run(new, "new", prefill_problems, prefill_cfg=cfg)
for cfg in decode_cfgs:
    run(new, "new", decode_problems, decode_cfg=cfg)
print(f"done {time.time()-t0:.0f}s", flush=True)
