"""Prefill/decode roles: a prefill engine hands each request's first token and prompt KV to a decode engine through
the hand-off frames (encoded to bytes and back), and the decode engine continues it token for token as a co-located
engine does. A transfer that is corrupt, cut short or has nowhere to go is refused whole, and no block leaks."""
from __future__ import annotations

import zlib

import msgspec
import numpy as np
import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine._C import add_fold_sums
from engine.engine import InvalidRequestError
from engine.kv_transfer import CHUNK_TRAILER_BYTES, ChunkLanding, FoldSums, Handoff, KvBegin, KvChunk, KvEnd, \
    KvImportRefused, KvLayout, KvReceiver, KvTransferError, chunk_checksum, chunk_trailer, decode_chunk_head, \
    decode_chunk_trailer, decode_frame, encode_chunk_head, encode_frame, read_blocks, rows_checksum, stream_blocks, \
    write_blocks
from scheduler.headroom import HANDED_OFF
from scheduler.slo import SLO

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# a small step budget: a 45-token prompt takes seven steps
ENGINE = dict(num_kv_blocks=48, max_num_batched_tokens=7, batch_policy="fcfs", block_size=8)


def random_prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def wire(frames):
    """Frames as a socket would carry them: encoded to bytes and decoded again."""
    return [decode_frame(encode_frame(f)) for f in frames]


def run(engine) -> dict:
    """Steps until idle; every request's outputs in order."""
    outs: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def import_whole(engine, handoff, pull):
    """One import on this thread as a worker makes it: reserve, `pull(first_block)` the frames, apply; on any
    failure the reservation given back and the error raised (KvImportRefused before anything was pulled)."""
    receiver = engine.reserve_import(handoff)
    try:
        for frame in pull(receiver.first_block):
            receiver.receive(frame)
        return engine.finish_import(receiver)
    except BaseException:
        engine.cancel_import(receiver)
        raise


class Pair:
    """A prefill and a decode engine, and the in-process hand-off between them."""

    def __init__(self, folder: str, decode_blocks: int | None = None, **config):
        self.prefill = LLM(folder, role="prefill", **config).engine
        decode_config = config if decode_blocks is None else {**config, "num_kv_blocks": decode_blocks}
        self.decode = LLM(folder, role="decode", **decode_config).engine
        self.free = self.free_counts()
        self.receivers = []

    def free_counts(self) -> tuple[int, int]:
        return self.prefill.blocks.num_free_blocks(), self.decode.blocks.num_free_blocks()

    def generate(self, prompts, params: SamplingParams, max_chunk_bytes: int = 1000) -> dict:
        """Every prompt through both engines; per request its outputs on the prefill side then the decode side."""
        ids = [f"r{len(self.receivers)}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.prefill.add_request(rid, prompt, params)
        outs = run(self.prefill)
        for rid in ids:
            if outs[rid][-1].finish_reason != "prefilled":
                continue
            handoff = decode_frame(encode_frame(self.prefill.handoff(rid)))
            receiver = self.decode.reserve_import(handoff)
            self.receivers.append(receiver)
            for frame in wire(self.prefill.export_kv(rid, receiver.first_block, max_chunk_bytes)):
                receiver.receive(frame)
            self.decode.finish_import(receiver)
            self.prefill.release_handoff(rid)
        for rid, later in run(self.decode).items():
            outs[rid] += later
        return {rid: outs[rid] for rid in ids}


def colocated(folder: str, prompts, params: SamplingParams, **config):
    return LLM(folder, **config).generate(prompts, params)


@pytest.fixture(scope="module")
def pair(llama_tiny):
    pair = Pair(llama_tiny[0], **ENGINE)
    yield pair
    assert pair.free_counts() == pair.free, "blocks leaked"


def test_greedy_handoff_equals_colocated_over_many_chunks_with_prefix_hits(llama_tiny, pair):
    vocab = llama_tiny[1].config.vocab_size
    first, other = random_prompts(vocab, [45, 30])
    # the third shares the first's leading 40 tokens: a prefix-cache hit on both sides
    prompts = [first, other, first[:40] + random_prompts(vocab, [9], seed=7)[0]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2)
    want = colocated(llama_tiny[0], prompts, params, **ENGINE)
    got = pair.generate(prompts[:2], params) | pair.generate(prompts[2:], params)
    prefill_steps = [s.num_prefill_tokens for s in pair.prefill.step_stats]
    assert max(prefill_steps) <= 7 and len(prefill_steps) >= (45 + 30) // 7
    assert any(s.num_decode_seqs for s in pair.decode.step_stats)
    for ref, outs in zip(want, got.values()):
        head, last = outs[0], outs[-1]
        assert head.finish_reason == "prefilled" and head.token_ids == ref.token_ids[:1]
        assert last.finish_reason == ref.finish_reason == "length"
        assert last.token_ids == ref.token_ids
        assert last.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert [t for t, _ in last.top_logprobs[0]] == [t for t, _ in ref.top_logprobs[0]]
        assert [t for o in outs for t in o.new_token_ids] == ref.token_ids  # the stream is the whole output once
        assert last.first_token_time == head.first_token_time
    shared = list(got.values())[2]
    assert shared[0].num_cached_tokens == 40 == shared[-1].num_cached_tokens
    assert pair.receivers[-1].first_block == 40 // ENGINE["block_size"]  # not sent again


def test_seeded_sampling_continues_as_colocated(llama_tiny, pair):
    prompts = random_prompts(llama_tiny[1].config.vocab_size, [19, 8], seed=3)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True)
    want = colocated(llama_tiny[0], prompts, params, **ENGINE)
    got = pair.generate(prompts, params)
    assert [outs[-1].token_ids for outs in got.values()] == [ref.token_ids for ref in want]
    greedy = colocated(llama_tiny[0], prompts, GREEDY, **ENGINE)
    assert [ref.token_ids[:12] for ref in want] != [ref.token_ids for ref in greedy]  # it did sample


def test_the_decode_side_decodes_from_the_imported_kv(llama_tiny):
    """A payload altered under valid checksums changes the continuation: the imported KV is what decodes (a
    fresh pair, so that the altered blocks reach no cache another test reads)."""
    prompt = random_prompts(llama_tiny[1].config.vocab_size, [33], seed=4)[0]
    honest = colocated(llama_tiny[0], [prompt], GREEDY, **ENGINE)[0].token_ids
    pair = Pair(llama_tiny[0], **ENGINE)
    pair.prefill.add_request("tampered", prompt, GREEDY)
    run(pair.prefill)
    receiver = pair.decode.reserve_import(pair.prefill.handoff("tampered"))
    assert receiver.first_block == 0
    held = pair.prefill.handoffs["tampered"]
    negated = pair.prefill.executor.kv_cache * -1.0  # the frames of other KV, checksummed as any
    for frame in wire(stream_blocks("tampered", negated, pair.prefill.kv_layout,
                                    list(pair.prefill.blocks.block_table(held.seq_id)), 0)):
        receiver.receive(frame)
    # its first token was on time: the decode engine reads the next, its first there, as a start (not packing)
    assert pair.decode.finish_import(receiver).standing == HANDED_OFF
    pair.prefill.release_handoff("tampered")
    tampered = run(pair.decode)["tampered"][-1].token_ids
    assert tampered[0] == honest[0] and tampered != honest
    assert pair.free_counts() == pair.free


def test_a_reserve_is_its_requests_and_crosses_a_handoff_as_the_importer_is_told(llama_tiny):
    """The share of a TPOT a request's router asks its engine to keep (the batch policy reads it off the request):
    checked at admission, carried by the hand-off, and replaced by the one the importing engine is told."""
    pair = Pair(llama_tiny[0], **ENGINE)
    prompt = random_prompts(llama_tiny[1].config.vocab_size, [20], seed=5)[0]
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(InvalidRequestError, match="tpot_reserve"):
            pair.prefill.add_request("bad", prompt, GREEDY, tpot_reserve=bad)
    assert "bad" not in pair.prefill.requests
    assert pair.prefill.add_request("r", prompt, GREEDY, tpot_reserve=0.25).tpot_reserve == 0.25
    run(pair.prefill)
    handoff = decode_frame(encode_frame(pair.prefill.handoff("r")))
    assert handoff.tpot_reserve == 0.25
    with pytest.raises(InvalidRequestError, match="tpot_reserve"):
        pair.decode.reserve_import(msgspec.structs.replace(handoff, tpot_reserve=1.5))
    assert pair.decode.blocks.num_free_blocks() == pair.free[1]
    req = import_whole(pair.decode, msgspec.structs.replace(handoff, tpot_reserve=0.1),
                       lambda first: wire(pair.prefill.export_kv("r", first, 1000)))
    assert req.tpot_reserve == 0.1
    pair.prefill.release_handoff("r")
    run(pair.decode)
    assert pair.free_counts() == pair.free


def corrupt_flip(frames):
    chunk = next(i for i, f in enumerate(frames) if isinstance(f, KvChunk) and f.index == 1)
    data = bytearray(frames[chunk].data)
    data[5] ^= 0x40
    frames[chunk] = msgspec.structs.replace(frames[chunk], data=bytes(data))
    return frames


def corrupt_checksum_of_all(frames):
    end = frames[-1]
    frames[-1] = KvEnd(end.request_id, end.num_chunks, end.checksum ^ 1)
    return frames


@pytest.mark.parametrize("fold", [4096, 128])
def test_the_chunk_checksum_sees_every_flipped_byte_and_a_changed_length(fold):
    """Over whole folds of 64-bit words (summed by column) and the bytes after them alike."""
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 13, dtype=np.uint8)
    honest = chunk_checksum(data, fold)
    assert chunk_checksum(data.tobytes(), fold) == chunk_checksum(memoryview(bytearray(data)), fold) == honest
    for position in range(len(data)):
        flipped = data.copy()
        flipped[position] ^= 1 << position % 8
        assert chunk_checksum(flipped, fold) != honest, position
    assert chunk_checksum(data[:-1], fold) != honest and chunk_checksum(np.append(data, 0), fold) != honest
    zeros = np.zeros(2 * 4096, dtype=np.uint8)
    assert chunk_checksum(zeros, fold) != chunk_checksum(zeros[:4096], fold)  # the length counts
    with pytest.raises(ValueError, match="fold_bytes must be a positive multiple of 8"):
        chunk_checksum(data, 12)


def test_the_fold_sums_are_numpys_column_sums_of_the_words_modulo_2_64():
    """`add_fold_sums` (the C++ sums under every checksum) against numpy's column sums of the same words: any
    number of rows (not only fours), words that wrap, data at any alignment; bad buffers named, the sums untouched."""
    rng = np.random.default_rng(5)
    for rows, width in ((0, 4), (1, 1), (3, 16), (4, 512), (9, 512), (13, 7)):
        raw = rng.integers(0, 256, 1 + rows * width * 8, dtype=np.uint8)
        raw[1:1 + 8 * width] = 0xFF  # a first row of all ones: its words wrap every column's sum
        for data in (raw[1:], raw[:-1]):  # one of them starts off a word's alignment
            start = rng.integers(0, 2**64, width, dtype=np.uint64)
            sums = start.copy()
            add_fold_sums(memoryview(data), sums)
            expected = (start + data.copy().view(np.uint64).reshape(rows, width).sum(axis=0, dtype=np.uint64))
            np.testing.assert_array_equal(sums, expected)
    sums = np.zeros(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="add_fold_sums: 40 bytes are no whole number of 32-byte folds"):
        add_fold_sums(bytes(40), sums)
    with pytest.raises(ValueError, match="add_fold_sums: data is not contiguous"):
        add_fold_sums(np.ones(128, dtype=np.uint8)[::2], sums)
    with pytest.raises(ValueError, match="sums must be a non-empty 1-D array of 64-bit words"):
        add_fold_sums(bytes(32), np.zeros(8, dtype=np.uint32))
    with pytest.raises((BufferError, ValueError), match="writable|read-only|readonly"):
        add_fold_sums(bytes(32), memoryview(bytes(32)).cast("Q"))
    assert not sums.any()


def test_the_checksum_over_rows_where_they_lie_is_that_of_their_bytes_joined():
    """`rows_checksum` of equally spaced rows (views of a cache's blocks), whole folds or not, and of a part of a
    row: `chunk_checksum` of the same bytes one after another."""
    planes = np.random.default_rng(2).integers(0, 256, (6, 5, 384), dtype=np.uint8)  # rows of 384 bytes
    for fold in (128, 4096):  # whole folds per row, or not
        for parts in ([planes[1:4, 2], planes[0:2, 4]], [planes[2, 3, 100:300][None], planes[0:6, 1]],
                      [planes[5, 0][None]]):
            joined = np.concatenate([part.reshape(-1) for part in parts])
            assert rows_checksum(parts, fold) == chunk_checksum(joined, fold), (fold, [p.shape for p in parts])
    layout = KvLayout(30, 3, 64, 16, "bfloat16")  # smollm2's blocks: 360 KiB, folded by 4 KiB
    assert (layout.block_bytes, layout.fold_bytes) == (368640, 4096)
    assert KvLayout(1, 1, 8, 4, "float32").fold_bytes == 256  # a block of 256 bytes
    assert KvLayout(1, 1, 3, 1, "bfloat16").fold_bytes == 4096  # a block that is no whole number of words


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])])
def test_a_devices_rows_are_checksummed_where_they_lie_to_the_same_checksum(device):
    """`rows_checksum` of tensor rows (a device's cache, summed on the device) is that of the same bytes on the
    host, whole folds or not, a part of a row, and words whose column sums wrap past 2**64."""
    host = np.random.default_rng(3).integers(0, 256, (6, 5, 384), dtype=np.uint8)
    host[:, :, :128] = 0xFF  # the first fold's words near 2**64: their sums wrap
    planes = torch.from_numpy(host).to(device)
    for fold in (128, 4096):
        for parts in ([(slice(1, 4), 2), (slice(0, 2), 4)], [(2, 3, slice(100, 300)), (slice(0, 6), 1)],
                      [(5, 0)], [(slice(0, 6), 0)]):
            on_host = [host[index] if host[index].ndim == 2 else host[index][None] for index in parts]
            on_device = [planes[index] if planes[index].dim() == 2 else planes[index][None] for index in parts]
            assert rows_checksum(on_device, fold) == rows_checksum(on_host, fold), (fold, parts)


def test_a_chunk_written_from_where_its_data_lies_decodes_as_the_chunk():
    """`encode_chunk_head`, the data, then `chunk_trailer`: the chunk's frame at every width of msgpack's bin
    header, decoded to the same fields as `encode_frame`'s bytes (which carry the checksum in msgpack's narrowest
    uint). The trailer is of fixed width, and `decode_chunk_trailer` reads it and the narrow forms alike, and
    nothing else."""
    data = np.random.default_rng(1).integers(0, 256, 70_000, dtype=np.uint8)
    for size in (0, 1, 255, 256, 65_535, 65_536, 70_000):
        checksum = chunk_checksum(data[:size], 4096)
        chunk = KvChunk("r", 3, memoryview(data[:size]), checksum)
        written = encode_chunk_head(chunk, size) + data[:size].tobytes() + chunk_trailer(checksum)
        for encoded in (written, encode_frame(chunk)):
            decoded = decode_frame(encoded)
            assert (decoded.request_id, decoded.index, bytes(decoded.data), decoded.checksum) == \
                ("r", 3, data[:size].tobytes(), checksum), size
    for checksum in (0, 127, 128, 255, 256, 2**16, 2**32 - 1, 2**32, 2**64 - 1):
        assert len(chunk_trailer(checksum)) == CHUNK_TRAILER_BYTES
        assert decode_chunk_trailer(chunk_trailer(checksum)) == checksum
        narrow = encode_frame(KvChunk("r", 0, b"", checksum))[len(encode_chunk_head(KvChunk("r", 0, b"", 0), 0)):]
        assert decode_chunk_trailer(narrow) == checksum and len(narrow) <= CHUNK_TRAILER_BYTES
    for bad in (b"", b"\xcf\x00", chunk_trailer(5) + b"\x00", b"\xc0", b"\x01\x02", b"\xa1x"):
        assert decode_chunk_trailer(bad) is None, bad


@pytest.mark.parametrize("max_chunk_bytes", [1024, 300, 100])
def test_a_senders_pieces_are_the_caches_blocks_themselves(max_chunk_bytes):
    """`KvExport.pieces` of scattered blocks from a resumed first block: each chunk's data is views of the cache's
    blocks (no copy), whole blocks where a block fits in a chunk (a run of consecutive ids one view), else parts of
    one; joined they are `read_blocks`' bytes, each chunk's checksum (summed as its parts are taken, or at once
    where they are no whole folds) is that of its bytes, and the iterated frames carry the same bytes and
    checksums."""
    cache = torch.randn(12, 2, 2, 4, 2, 8).to(torch.bfloat16)  # 512-byte blocks
    layout, blocks = KvLayout.of_cache(cache, 4), [5, 0, 9, 10, 3, 11, 7]
    pieces, chunks = [], []
    for frame, data in stream_blocks("p", cache, layout, blocks, 2, max_chunk_bytes).pieces():
        pieces.append((frame, data))
        if data is not None:
            if max_chunk_bytes >= 512:  # whole folds: summed as the parts are taken
                with pytest.raises(RuntimeError, match="once all its parts were taken"):
                    data.checksum
            chunks.append((frame, data, [buffer for part in data.parts() for buffer in part], data.checksum))
    frames = list(stream_blocks("p", cache, layout, blocks, 2, max_chunk_bytes))
    raw = cache.view(torch.uint8).numpy()
    sizes = [data.nbytes for _, data, _, _ in chunks]
    assert pieces[0][0].num_chunks == len(chunks) and pieces[0][0].total_bytes == sum(sizes) == 5 * 512
    assert all(isinstance(frame, KvChunk) for frame, _, _, _ in chunks) and pieces[-1][1] is None
    if max_chunk_bytes >= 512:
        assert [[d.nbytes for d in data.buffers] for _, data, _, _ in chunks] == [[1024], [512, 512], [512]]
    else:
        assert sizes == ([max_chunk_bytes] * (512 // max_chunk_bytes) + [512 % max_chunk_bytes]) * 5
    for _, data, buffers, checksum in chunks:
        assert sum(b.nbytes for b in buffers) == data.nbytes
        assert all(np.shares_memory(np.frombuffer(d, dtype=np.uint8), raw) for d in buffers)
        assert checksum == chunk_checksum(b"".join(buffers), layout.fold_bytes)
    joined = b"".join(bytes(d) for _, _, buffers, _ in chunks for d in buffers)
    assert joined == read_blocks(cache, blocks[2:]).tobytes()
    assert [f.checksum for f in frames[1:-1]] == [checksum for _, _, _, checksum in chunks]
    assert b"".join(bytes(f.data) for f in frames[1:-1]) == joined and frames[-1] == pieces[-1][0]
    with pytest.raises(ValueError, match="contiguous cache only"):
        stream_blocks("p", cache.transpose(3, 4), layout, blocks, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("max_chunk_bytes", [1024, 300])
def test_a_devices_export_sends_what_the_hosts_export_of_the_same_cache_sends(max_chunk_bytes):
    """From a device's cache each chunk crosses into pinned memory on a stream of the transfer's own, the next one
    while a transport takes this one: frame for frame the bytes and checksums of the same cache exported from the
    host, whole folds (summed on the device) or not (300-byte chunks), after the writes the engine's stream queued
    into the blocks before the export began; and again from the buffers a first export gave back."""
    cache = torch.randn(12, 2, 2, 4, 2, 8, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    layout, blocks = KvLayout.of_cache(cache, 4), [5, 0, 9, 10, 3, 11, 7]
    want = list(stream_blocks("g", cache, layout, blocks, 1, max_chunk_bytes))
    for _ in range(2):
        source, device = cache.cuda(), torch.zeros_like(cache, device="cuda")
        torch.cuda._sleep(50_000_000)  # the engine's stream busy: the blocks' bytes land after this
        device.copy_(source)
        got = []
        for frame, data in stream_blocks("g", device, layout, blocks, 1, max_chunk_bytes).pieces():
            if data is not None:
                joined = memoryview(b"".join(bytes(buffer) for part in data.parts() for buffer in part))
                frame = KvChunk(frame.request_id, frame.index, joined, data.checksum)
            got.append(frame)
        assert got == want


@pytest.mark.parametrize("damage, message", [
    (corrupt_flip, "chunk 1 fails its checksum"),
    (lambda frames: frames[:-1], "not complete"),  # the end never came
    (lambda frames: frames[:2] + frames[3:], "chunk 2 where chunk 1 was due"),  # a chunk lost
    (lambda frames: frames[:-2] + frames[-1:], "cut short"),  # the last chunk lost
    (corrupt_checksum_of_all, "payload fails its checksum"),
    (lambda frames: frames[1:], "KvChunk before KvBegin"),
])
def test_a_damaged_transfer_is_refused_whole(llama_tiny, pair, damage, message):
    prompt = random_prompts(llama_tiny[1].config.vocab_size, [37], seed=5)[0]
    pair.prefill.add_request("damaged", prompt, GREEDY)
    run(pair.prefill)
    decode_free = pair.decode.blocks.num_free_blocks()
    sent = []

    def pull(first_block):
        sent.extend(wire(pair.prefill.export_kv("damaged", first_block, max_chunk_bytes=256)))
        return damage(list(sent))

    with pytest.raises(KvTransferError, match=message):
        import_whole(pair.decode, pair.prefill.handoff("damaged"), pull)
    assert sum(isinstance(f, KvChunk) for f in sent) > 3
    assert all(len(f.data) <= 256 for f in sent if isinstance(f, KvChunk))
    assert pair.decode.blocks.num_free_blocks() == decode_free
    assert "damaged" not in pair.decode.requests and not pair.decode.imports
    # the prefill side still holds it: a retry succeeds
    request = import_whole(pair.decode, pair.prefill.handoff("damaged"),
                           lambda first: wire(pair.prefill.export_kv("damaged", first)))
    pair.prefill.release_handoff("damaged")
    assert run(pair.decode)["damaged"][-1].token_ids[:1] == request.output_token_ids[:1]


def test_a_full_decode_engine_refuses_before_any_transfer(llama_tiny):
    folder = llama_tiny[0]
    pair = Pair(folder, decode_blocks=8, **ENGINE)
    long, short = random_prompts(llama_tiny[1].config.vocab_size, [50, 20], seed=6)
    pair.prefill.add_request("long", long, GREEDY)
    pair.prefill.add_request("short", short, GREEDY)
    run(pair.prefill)
    import_whole(pair.decode, pair.prefill.handoff("long"), lambda first: pair.prefill.export_kv("long", first))
    pair.prefill.release_handoff("long")  # 7 of 8 blocks taken on the decode side
    handoff = pair.prefill.handoff("short")
    free = pair.decode.blocks.num_free_blocks()
    pulled = []
    with pytest.raises(KvImportRefused, match="needs 3 KV blocks, 1 are free"):
        import_whole(pair.decode, handoff, lambda first: pulled.append(first) or [])
    assert not pulled and pair.decode.blocks.num_free_blocks() == free
    run(pair.decode)  # the long one finishes and frees its blocks: now it fits
    import_whole(pair.decode, handoff, lambda first: pair.prefill.export_kv("short", first))
    pair.prefill.release_handoff("short")
    assert run(pair.decode)["short"][-1].token_ids == colocated(folder, [short], GREEDY, **ENGINE)[0].token_ids
    assert pair.free_counts() == pair.free


def test_roles_and_what_each_refuses(llama_tiny, pair):
    prompt = random_prompts(llama_tiny[1].config.vocab_size, [10], seed=8)[0]
    # a first token that ends the request ends it on the prefill side: nothing to hand off
    pair.prefill.add_request("one", prompt, SamplingParams(temperature=0, max_tokens=1))
    assert run(pair.prefill)["one"][-1].finish_reason == "length" and not pair.prefill.handoffs
    pair.prefill.add_request("held", prompt, GREEDY)
    run(pair.prefill)
    handoff = pair.prefill.handoff("held")
    with pytest.raises(KvTransferError, match="'prefill' engine imports no KV"):
        pair.prefill.reserve_import(handoff)
    assert pair.prefill.hand_over("held") is None  # held for its hand-off already, not decoding
    colocated_engine = LLM(llama_tiny[0], **ENGINE).engine  # a co-located engine takes moved requests
    colocated_engine.cancel_import(colocated_engine.reserve_import(handoff))
    with pytest.raises(KeyError, match="not held here"):
        pair.prefill.export_kv("nobody")
    receiver = pair.decode.reserve_import(handoff)
    with pytest.raises(KvTransferError, match="not complete"):
        pair.decode.finish_import(receiver)
    pair.decode.abort("held")  # gives the reservation back
    assert not pair.decode.imports
    pair.prefill.abort("held")  # frees what the prefill side held
    assert not pair.prefill.handoffs
    with pytest.raises(KvTransferError, match="not a KV hand-off frame"):
        decode_frame(b"\x93\xa3xyz")


def test_handoff_between_emulated_engines_carries_no_kv(default_model):
    """An engine that runs no model has no KV to send: the hand-off is the request's state alone."""
    config = dict(executor="emulated", num_kv_blocks=32, step_time=lambda *_: 0.0)
    pair = Pair(default_model, **config)
    prompt = list(range(100, 140))
    got = pair.generate([prompt], GREEDY)
    want = colocated(default_model, [prompt], GREEDY, **config)[0]
    assert next(iter(got.values()))[-1].token_ids == want.token_ids
    assert pair.receivers[0].total_bytes == 0
    assert pair.free_counts() == pair.free


def test_real_model_greedy_text_with_a_stop_string(default_model):
    """SmolLM2: the same text token for token, cut at the same stop string, and the stream (prefill side's first
    delta, then the decode side's) adds up to the co-located stream."""
    config = dict(num_kv_blocks=64, max_num_batched_tokens=16, batch_policy="fcfs")
    free_run = LLM(default_model, **config)
    chat = free_run.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours of the sky."}])
    text = free_run.generate([chat], SamplingParams(temperature=0, max_tokens=24))[0].text
    stop = text.split()[3]  # a word well into the answer: decoding on the decode side meets it
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    want_outs = []
    free_run.engine.add_request("ref", chat, params)
    while free_run.engine.has_unfinished():
        want_outs += free_run.engine.step()
    pair = Pair(default_model, **config)
    got = pair.generate([chat, chat], params, max_chunk_bytes=64 << 10)
    assert pair.receivers[1].first_block > 0  # the first one's blocks are in the decode side's prefix cache
    for outs in got.values():
        assert outs[0].finish_reason == "prefilled"
        assert outs[-1].text == want_outs[-1].text and outs[-1].finish_reason == "stop"
        assert outs[-1].token_ids == want_outs[-1].token_ids
        assert "".join(o.new_text for o in outs) == "".join(o.new_text for o in want_outs)
    assert pair.free_counts() == pair.free


def test_role_is_a_checked_engine_flag():
    from engine.serve import main

    config = EngineConfig(executor="emulated", role="decode")
    assert config.to_args()[-2:] == ["--role", "decode"] and EngineConfig(**config.options()) == config
    with pytest.raises(ValueError, match="role must be one of both, prefill, decode"):
        EngineConfig(role="router")
    with pytest.raises(SystemExit):  # one engine behind HTTP serves whole requests
        main(["--executor", "emulated", "--role", "prefill"])


def test_a_decode_engine_runs_a_whole_request_as_a_colocated_one(llama_tiny):
    """The router's convertible decode instances: given a new request (no hand-off), a decode engine prefills it
    itself and gives the co-located text."""
    prompts = random_prompts(llama_tiny[1].config.vocab_size, [30, 12], seed=9)
    decode = LLM(llama_tiny[0], role="decode", **ENGINE)
    got = decode.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in colocated(llama_tiny[0], prompts, GREEDY, **ENGINE)]
    assert any(s.num_prefill_tokens for s in decode.engine.step_stats)


def staged(receiver: KvReceiver, frames, damage=lambda index, memory: None) -> None:
    """The frames fed as a transport that reads a chunk's head first does: each chunk's data put into the receiver's
    `chunk_memory` (`damage(index, memory)` after, as a faulty link would), then the chunk received with it."""
    for frame in frames:
        if isinstance(frame, KvChunk):
            memory = receiver.chunk_memory(len(frame.data))
            memory.write(frame.data)
            damage(frame.index, memory)
            frame = msgspec.structs.replace(frame, data=memory)
        receiver.receive(frame)


def prefilled(llama_tiny, pair, request_id: str, length: int, seed: int):
    prompt = random_prompts(llama_tiny[1].config.vocab_size, [length], seed=seed)[0]
    pair.prefill.add_request(request_id, prompt, GREEDY)
    run(pair.prefill)
    return pair.prefill.handoff(request_id)


def test_chunks_read_into_chunk_memory_land_in_their_blocks_as_they_come(llama_tiny, pair):
    """Chunks not aligned to blocks, their data put where `chunk_memory` says, on a CPU cache: each chunk is in its
    reserved blocks once received, the rest of the cache (the prefix-cached leading blocks included) as it was."""
    vocab = llama_tiny[1].config.vocab_size
    shared = random_prompts(vocab, [24], seed=17)[0]
    pair.generate([shared + random_prompts(vocab, [5], seed=18)[0]], GREEDY)  # its 3 full blocks cached on both
    pair.prefill.add_request("staged", shared + random_prompts(vocab, [21], seed=7)[0], GREEDY)
    run(pair.prefill)
    handoff = pair.prefill.handoff("staged")
    before = pair.decode.executor.kv_cache.clone()
    receiver = pair.decode.reserve_import(handoff)
    pulled = receiver.block_ids[receiver.first_block:handoff.num_blocks]
    assert receiver.first_block == 3 and receiver.in_place and receiver.payload is None
    frames = list(pair.prefill.export_kv("staged", receiver.first_block, max_chunk_bytes=300))
    sent = b"".join(bytes(f.data) for f in frames if isinstance(f, KvChunk))
    assert len(frames) > 5 and len(sent) == receiver.total_bytes
    for frame in frames:
        staged(receiver, [frame])
        if isinstance(frame, KvChunk):  # this chunk and those before it are in their blocks, nothing after them
            landed = read_blocks(pair.decode.executor.kv_cache, pulled)
            end = sum(len(f.data) for f in frames[1:frame.index + 2])
            assert landed[:end].tobytes() == sent[:end]
            assert landed[end:].tobytes() == read_blocks(before, pulled)[end:].tobytes()
    others = [b for b in range(before.shape[0]) if b not in pulled]
    assert torch.equal(pair.decode.executor.kv_cache[others].view(torch.uint8), before[others].view(torch.uint8))
    pair.decode.finish_import(receiver)
    assert read_blocks(pair.decode.executor.kv_cache, pulled).tobytes() == sent
    pair.prefill.release_handoff("staged")
    run(pair.decode)


def test_a_corrupted_chunk_is_refused_and_what_came_before_it_never_decodes(llama_tiny, pair):
    """The chunk before it is in the reserved blocks (a CPU cache), and it lands in its blocks, where its check fails;
    the import fails, the blocks go back with no prefix-cache entry naming them, and the same prompt later is
    computed afresh, as a co-located engine computes it. Nothing after it, nor outside the reserved blocks,
    changed."""
    prompt = random_prompts(llama_tiny[1].config.vocab_size, [40], seed=8)[0]
    pair.prefill.add_request("flipped", prompt, GREEDY)
    run(pair.prefill)
    handoff = pair.prefill.handoff("flipped")
    decode_free, cache = pair.decode.blocks.num_free_blocks(), pair.decode.executor.kv_cache.clone()
    receiver = pair.decode.reserve_import(handoff)
    reserved = receiver.block_ids
    frames = list(pair.prefill.export_kv("flipped", receiver.first_block, max_chunk_bytes=256))

    def flip(index: int, memory: ChunkLanding) -> None:
        if index == 1:
            memory.buffers[0][5] ^= 0x20

    with pytest.raises(KvTransferError, match="chunk 1 fails its checksum"):
        staged(receiver, frames, flip)
    assert not receiver.complete and receiver.first_block == 0
    landed = read_blocks(pair.decode.executor.kv_cache, reserved[:handoff.num_blocks])
    first, second = len(frames[1].data), len(frames[1].data) + len(frames[2].data)
    assert landed[:first].tobytes() == bytes(frames[1].data)  # chunk 0 is in its blocks
    assert landed[first:second].tobytes() != bytes(frames[2].data)  # chunk 1 too, with its flipped byte
    assert landed[second:].tobytes() == read_blocks(cache, reserved[:handoff.num_blocks])[second:].tobytes()
    with pytest.raises(KvTransferError, match="not complete"):
        pair.decode.finish_import(receiver)
    pair.decode.cancel_import(receiver)
    others = [b for b in range(cache.shape[0]) if b not in reserved]
    assert torch.equal(pair.decode.executor.kv_cache[others].view(torch.uint8),
                       cache[others].view(torch.uint8))  # NaNs too
    assert pair.decode.blocks.num_free_blocks() == decode_free and not pair.decode.imports
    pair.prefill.release_handoff("flipped")
    pair.decode.add_request("again", prompt, GREEDY)  # a decode engine prefills what it is given as a new request
    again = run(pair.decode)["again"][-1]
    assert again.num_cached_tokens == 0
    assert again.token_ids == colocated(llama_tiny[0], [prompt], GREEDY, **ENGINE)[0].token_ids


def test_a_cancelled_receiver_writes_nothing_more_and_refuses_what_comes():
    """`cancel` (the engine giving the blocks back, from its thread) ends the writes into the cache: a chunk after
    it is refused and its bytes go nowhere. In place too with a resumed first block and scattered block ids: the
    chunks land in the blocks from the first pulled one, the leading one untouched."""
    layout = KvLayout(2, 1, 8, 4, "float32")  # 512-byte blocks
    cache = torch.zeros(8, 2, 2, 4, 1, 8)
    handoff = Handoff("c", [0] * 12, 0, SamplingParams(), SLO(1.0, 0.1), "t", 0.0, 0.0, None, 0, 0, layout, 3)
    receiver = KvReceiver(handoff, 0, [4, 6, 1, 7], 1, cache)
    assert receiver.in_place and receiver.total_bytes == 1024
    data = np.random.default_rng(5).integers(1, 256, 1024, dtype=np.uint8)
    receiver.receive(KvBegin("c", layout, 1, 3, 1024, 2))
    fold = layout.fold_bytes
    staged(receiver, [KvChunk("c", 0, memoryview(data[:700]), chunk_checksum(data[:700], fold))])
    landed = read_blocks(cache, [6, 1])
    assert landed[:700].tobytes() == data[:700].tobytes() and not landed[700:].any()
    assert not cache[[0, 2, 3, 4, 5, 7]].any()
    landing = receiver.chunk_memory(324)  # taken before the cancel: filled after it, it writes nothing
    receiver.cancel()
    with pytest.raises(KvTransferError, match="the import was cancelled"):
        landing.write(data[700:])
    with pytest.raises(KvTransferError, match="after the transfer was cancelled"):
        receiver.receive(KvChunk("c", 1, memoryview(data[700:]), chunk_checksum(data[700:], fold)))
    assert not read_blocks(cache, [6, 1])[700:].any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])])
def test_a_devices_import_crosses_into_its_blocks_as_it_comes_and_is_checked_there(device):
    """Into a device's cache each chunk crosses from staging into its reserved blocks as it comes, and `apply`
    checks what landed there: a corrupt chunk raises then, and no block but the reserved ones is touched; an honest
    transfer lands whole, chunks of whole folds (summed on the device) or not (384-byte chunks of 512-byte blocks).
    On the CPU, staged with no cache, each chunk is checked as it comes."""
    layout = KvLayout(2, 1, 8, 4, "float32")  # 512-byte blocks
    source = torch.randn(8, 2, 2, 4, 1, 8, generator=torch.Generator().manual_seed(4))
    handoff = Handoff("d", [0] * 12, 0, SamplingParams(), SLO(1.0, 0.1), "t", 0.0, 0.0, None, 0, 0, layout, 3)
    for corrupt, max_chunk_bytes in ((True, 384), (False, 384), (True, 512), (False, 512)):
        frames = list(stream_blocks("d", source, layout, [3, 5, 0], 1, max_chunk_bytes))
        cache = torch.zeros(8, 2, 2, 4, 1, 8).to(device)
        receiver = KvReceiver(handoff, 0, [6, 1, 7], 1, cache if device == "cuda" else None)
        assert receiver.checked_on_device == (device == "cuda") and not receiver.in_place
        for frame in frames:
            if corrupt and isinstance(frame, KvChunk) and frame.index == 1:
                data = bytearray(frame.data)
                data[5] ^= 1
                frame = KvChunk(frame.request_id, frame.index, memoryview(data), frame.checksum)
            if corrupt and device == "cpu" and isinstance(frame, KvChunk) and frame.index == 1:
                with pytest.raises(KvTransferError, match="chunk 1 fails its checksum"):
                    receiver.receive(frame)
                break
            receiver.receive(frame)
        else:
            if corrupt:
                with pytest.raises(KvTransferError, match="chunk 1 fails its checksum"):
                    receiver.apply()
                assert not cache[[0, 2, 3, 4, 5, 6]].any()
            elif device == "cuda":
                receiver.apply()
                assert torch.equal(cache[[1, 7]], source[[5, 0]].to(device))
                assert not cache[[0, 2, 3, 4, 5, 6]].any()
            else:
                assert receiver.complete


def zlib_chain(checksums: list[int]) -> int:
    """KvEnd's checksum of chunks with these checksums: the CRC-32 of them, in order."""
    return zlib.crc32(b"".join(c.to_bytes(4, "big") for c in checksums))


def test_chunk_memory_is_given_only_for_a_due_chunk_within_the_announced_payload():
    layout = KvLayout(1, 1, 8, 4, "float32")  # 256-byte blocks
    handoff = Handoff("m", [0] * 12, 0, SamplingParams(), SLO(1.0, 0.1), "t", 0.0, 0.0, None, 0, 0, layout, 3)
    receiver = KvReceiver(handoff, 0, [4, 1, 6], 1)
    with pytest.raises(KvTransferError, match="no chunk is due .before KvBegin"):
        receiver.chunk_memory(16)
    receiver.receive(KvBegin("m", layout, 1, 3, 512, 2))
    with pytest.raises(KvTransferError, match="a chunk of 513 bytes runs past the announced 512 bytes"):
        receiver.chunk_memory(513)
    data = np.arange(512, dtype=np.uint16).astype(np.uint8)
    fold = layout.fold_bytes
    staged(receiver, [KvChunk("m", 0, memoryview(data[:300]), chunk_checksum(data[:300], fold))])
    with pytest.raises(KvTransferError, match="runs past the announced 512 bytes .300 received"):
        receiver.chunk_memory(213)
    memory = receiver.chunk_memory(212)
    assert np.shares_memory(np.frombuffer(memory.buffers[0], dtype=np.uint8), receiver.payload.numpy())
    memory.write(data[300:400])
    with pytest.raises(KvTransferError, match="chunk 1 landed 100 of its 212 bytes"):
        receiver.receive(KvChunk("m", 1, memory, chunk_checksum(data[300:], fold)))
    memory = receiver.chunk_memory(212)
    memory.write(data[300:])
    with pytest.raises(ValueError, match="1 bytes do not fit in the 0 unfilled"):
        memory.write(b"x")
    receiver.receive(KvChunk("m", 1, memory, chunk_checksum(data[300:], fold)))
    receiver.receive(KvEnd("m", 2, zlib_chain([chunk_checksum(data[:300], fold), chunk_checksum(data[300:], fold)])))
    assert receiver.complete and receiver.payload.numpy().tobytes() == data.tobytes()
    with pytest.raises(KvTransferError, match="no chunk is due .the transfer ended"):
        receiver.chunk_memory(1)


def test_a_landing_sums_its_bytes_as_they_come_to_the_chunks_checksum():
    """A chunk read into its scattered blocks in reads of any size (cut inside folds and across blocks) is summed
    as it lands to `chunk_checksum` of its bytes; the receiver checks it by that sum, and a flipped byte fails it.
    `FoldSums` takes whole folds only."""
    layout = KvLayout(2, 1, 8, 4, "float32")  # 512-byte blocks, folded by 512
    handoff = Handoff("s", [0] * 12, 0, SamplingParams(), SLO(1.0, 0.1), "t", 0.0, 0.0, None, 0, 0, layout, 3)
    data = np.random.default_rng(8).integers(0, 256, 1536, dtype=np.uint8)
    for flip in (None, 700):
        cache = torch.zeros(8, 2, 2, 4, 1, 8)
        receiver = KvReceiver(handoff, 0, [6, 2, 3], 0, cache)  # blocks 2 and 3: one run
        receiver.receive(KvBegin("s", layout, 0, 3, 1536, 1))
        landing = receiver.chunk_memory(1536)
        assert [b.nbytes for b in landing.buffers] == [512, 1024]
        sent = data.copy()
        if flip is not None:
            sent[flip] ^= 4
        at = 0
        for size in (3, 509, 600, 1, 423):
            landing.write(sent[at:at + size])
            at += size
        assert landing.checksum() == chunk_checksum(sent, layout.fold_bytes)
        honest = KvChunk("s", 0, landing, chunk_checksum(data, layout.fold_bytes))
        if flip is not None:
            with pytest.raises(KvTransferError, match="chunk 0 fails its checksum"):
                receiver.receive(honest)
            continue
        receiver.receive(honest)
        receiver.receive(KvEnd("s", 1, zlib_chain([honest.checksum])))
        assert receiver.complete and read_blocks(cache, [6, 2, 3]).tobytes() == data.tobytes()
    with pytest.raises(ValueError, match="100 bytes are no whole number of 512-byte folds"):
        FoldSums(512).add(memoryview(bytes(100)))


def test_a_chunk_head_decodes_from_the_leading_bytes_alone():
    """`decode_chunk_head` of a chunk's bytes from its start up to any point in its data: the chunk's fields,
    where its data starts and its size, at every width of msgpack's str, int and bin headers; None for a head cut
    short, another frame, or bytes that are none."""
    data = bytes(range(256)) * 300
    for request_id in ("r", "x" * 40, "y" * 300):
        for index, checksum in ((0, 0), (127, 128), (70_000, 2**32 - 1), (2**33, 2**16)):
            for size in (0, 255, 256, 65_535, 65_536, 70_000):
                head = encode_chunk_head(KvChunk(request_id, index, memoryview(data[:size]), checksum), size)
                chunk, start, nbytes = decode_chunk_head(head + data[:9])
                assert (chunk.request_id, chunk.index, chunk.checksum, bytes(chunk.data)) == (request_id, index, 0, b"")
                assert (start, nbytes) == (len(head), size)
            assert all(decode_chunk_head(head[:cut]) is None for cut in range(len(head)))
    layout = KvLayout(1, 1, 8, 4, "float32")
    for other in (KvBegin("r", layout, 0, 1, 128, 1), KvEnd("r", 1, 5)):
        assert decode_chunk_head(encode_frame(other)) is None
    assert decode_chunk_head(b"") is None and decode_chunk_head(b"\x95\x00garbage") is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])])
def test_write_blocks_puts_each_block_in_its_place_and_no_other(device):
    """One indexed copy of host bytes into scattered blocks (pinned host bytes, on CUDA), the inverse of
    `read_blocks`; the blocks not named keep their bytes."""
    cache = torch.randn(10, 3, 2, 4, 2, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    cache = cache.to(device)
    before, ids = cache.clone(), [7, 2, 9, 0]
    block_bytes = KvLayout.of_cache(cache, 4).block_bytes
    payload = torch.randint(0, 256, (len(ids) * block_bytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(3))
    if device == "cuda":
        payload = payload.pin_memory()
    write_blocks(cache, ids, payload)
    assert np.array_equal(read_blocks(cache, ids), payload.numpy())
    others = [b for b in range(10) if b not in ids]
    assert torch.equal(cache[others], before[others])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)])
def test_a_request_handed_over_mid_stream_goes_on_elsewhere_token_for_token(llama_tiny, params):
    """Two co-located engines (role both): requests decoding on one are let go of between steps a few tokens in,
    and the other pulls their KV and output so far and finishes them as the first alone would have (greedy with
    logprobs, seeded sampling), the stream holding every token and all the text once; blocks back on both."""
    folder, vocab = llama_tiny[0], llama_tiny[1].config.vocab_size
    prompts = random_prompts(vocab, [45, 30])
    want = colocated(folder, prompts, params, **ENGINE)
    source, target = LLM(folder, **ENGINE).engine, LLM(folder, **ENGINE).engine
    free = source.blocks.num_free_blocks(), target.blocks.num_free_blocks()
    ids = [f"m{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        source.add_request(rid, prompt, params)
    outs: dict = {}
    while not all(rid in outs and len(outs[rid][-1].token_ids) >= 3 + i for i, rid in enumerate(ids)):
        for out in source.step():
            outs.setdefault(out.request_id, []).append(out)
    for rid in ids:
        out = source.hand_over(rid)
        assert out.finish_reason == "prefilled" and out.new_token_ids == [] and out.handoff.later_tokens
        handoff = decode_frame(encode_frame(out.handoff))
        assert handoff.output_token_ids == out.token_ids
        receiver = target.reserve_import(handoff)
        for frame in wire(source.export_kv(rid, receiver.first_block, 1000)):
            receiver.receive(frame)
        target.finish_import(receiver)
        source.release_handoff(rid)
        outs[rid].append(out)
    assert not source.has_unfinished() and source.hand_over(ids[0]) is None  # gone from here
    for rid, later in run(target).items():
        outs[rid] += later
    for ref, rid in zip(want, ids):
        last = outs[rid][-1]
        assert last.finish_reason == "length" and last.token_ids == ref.token_ids
        assert [t for o in outs[rid] for t in o.new_token_ids] == ref.token_ids
        assert "".join(o.new_text for o in outs[rid]) == ref.text
        if params.logprobs:
            assert last.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert (source.blocks.num_free_blocks(), target.blocks.num_free_blocks()) == free


def test_only_a_decoding_request_is_handed_over(llama_tiny):
    engine = LLM(llama_tiny[0], **ENGINE).engine
    engine.add_request("p", random_prompts(llama_tiny[1].config.vocab_size, [45])[0], GREEDY)
    engine.step()  # its prompt takes seven steps: not decoding yet
    assert engine.hand_over("p") is None and engine.hand_over("nobody") is None
    assert run(engine)["p"][-1].finish_reason == "length"
