"""Structured-output overhead per engine step: `batch` decodes held to a JSON schema against as many free ones.

    python -m bench.structured_output [--batch 16] [--tokens 48] [--repeats 3] [--model PATH] [--dtype bfloat16]

Two measurements on the same model and prompts:
- Engine steps: the median wall time of steps whose batch is exactly `batch` decodes, for free requests (no
  grammar) and for grammar requests (json_schema), runs alternating `--repeats` times; the difference is what the
  grammars cost a step, all included.
- Its parts, without the model: `batch` matchers replay the documents the grammar run produced, and every step is
  timed in three parts: the mask built (the batch's bitmask filled by xgrammar), applied to `batch` rows of logits of
  the model's width in one call, and the matchers advanced by one token each. Medians over steps.
Times are wall-clock on this machine's CPU (`time.perf_counter`), so a busy machine inflates them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.structured_output import JSON_SCHEMA, GrammarMask, StructuredOutput

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}}, "bio": {"type": "string"}},
    "required": ["name", "age", "city", "hobbies", "bio"]}
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Perth", "Dakar"]


def prompts(llm: LLM, n: int) -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": (
        f"Describe person number {i}, who lives in {CITIES[i % len(CITIES)]}, as JSON with a name, age, city, "
        "hobbies and a long bio.")}]) for i in range(n)]


def full_batch_steps(llm: LLM, ids: list[list[int]], params: SamplingParams,
                     batch: int) -> tuple[list[float], list]:
    """The run's outputs, and the wall seconds of its steps that decode exactly `batch` sequences and prefill
    nothing."""
    start = llm.engine.num_steps
    outs = llm.generate(ids, params)
    stats = list(llm.engine.step_stats)[-(llm.engine.num_steps - start):]
    return [s.duration for s in stats if s.num_decode_seqs == batch and s.num_prefill_tokens == 0], outs


def step_parts(llm: LLM, spec: StructuredOutput, documents: list[list[int]]) -> dict[str, list[float]]:
    """Seconds per step of each part, matchers replaying `documents` (all rows while every document lasts)."""
    grammars = llm.engine.grammars
    vocab = llm.engine.executor.vocab_size
    matchers = [grammars.matcher(spec) for _ in documents]
    logits = torch.randn(len(documents), vocab)
    parts = {"mask build": [], "mask apply": [], "matcher advance": []}
    clock = time.perf_counter
    for k in range(min(len(d) for d in documents)):
        t0 = clock()
        mask = GrammarMask.of(matchers, vocab)
        bitmask = mask.bitmask()
        t1 = clock()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=mask.rows)
        t2 = clock()
        for m, doc in zip(matchers, documents):
            if not m.accept_token(doc[k]):
                raise RuntimeError("a replayed document left its grammar")
        t3 = clock()
        parts["mask build"].append(t1 - t0)
        parts["mask apply"].append(t2 - t1)
        parts["matcher advance"].append(t3 - t2)
    return parts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Hugging Face folder (default: the default model)")
    ap.add_argument("--dtype", default=None, help="float32 (the CPU default) or bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens of every request")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    llm = LLM(args.model, max_model_len=1024, num_kv_blocks=args.batch * 24, max_num_seqs=args.batch,
              dtype=args.dtype)
    ids = prompts(llm, args.batch)
    spec = StructuredOutput(JSON_SCHEMA, json.dumps(SCHEMA))
    free = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    grammar = SamplingParams(temperature=0, max_tokens=args.tokens, structured_output=spec)
    llm.generate(ids, SamplingParams(temperature=0, max_tokens=4))  # warm-up, and the grammar compiled below
    llm.engine.compile_grammar(grammar)
    steps = {"free": [], "grammar": []}
    documents = None
    for _ in range(args.repeats):
        steps["free"] += full_batch_steps(llm, ids, free, args.batch)[0]
        grammar_steps, outs = full_batch_steps(llm, ids, grammar, args.batch)
        steps["grammar"] += grammar_steps
        documents = [o.token_ids for o in outs]
    print(f"model {llm.config.model or 'default'}, vocab {llm.engine.executor.vocab_size}, batch {args.batch}, "
          f"max_tokens {args.tokens}, dtype {llm.engine.executor.kv_cache.dtype}, {torch.get_num_threads()} threads")
    free_ms, grammar_ms = (1000 * statistics.median(steps[k]) for k in ("free", "grammar"))
    print(f"engine step, {args.batch} decodes: free {free_ms:.2f} ms (n={len(steps['free'])}), "
          f"json_schema {grammar_ms:.2f} ms (n={len(steps['grammar'])}): +{grammar_ms - free_ms:.2f} ms "
          f"({100 * (grammar_ms / free_ms - 1):+.1f} %)")
    parts = step_parts(llm, spec, documents)
    total = 0.0
    for name, values in parts.items():
        ms = 1000 * statistics.median(values)
        total += ms
        print(f"  {name:16s} {ms:7.3f} ms per step (median of {len(values)} steps)")
    print(f"  {'sum':16s} {total:7.3f} ms per step")
    print(f"  documents: {min(map(len, documents))}-{max(map(len, documents))} tokens; first: "
          f"{llm.tokenizer.decode(documents[0])!r}")


if __name__ == "__main__":
    main()
