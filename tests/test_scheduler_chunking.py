"""Dynamic chunking when the latency model can solve for the chunk itself."""
import random

from scheduler import H200_SXM, LLAMA_3_1_8B, RooflineLatencyModel, largest_chunk


def test_largest_chunk_from_the_roofline_root_equals_the_binary_search():
    """The roofline solves for the chunk (chunk_within); the search from its root must land where bisection over
    predict alone does, budgets near and far, with and without prefill already in the batch."""
    roofline = RooflineLatencyModel(H200_SXM, LLAMA_3_1_8B)

    class PredictOnly:
        predict = staticmethod(roofline.predict)

    rng = random.Random(7)
    for _ in range(4000):
        decodes, kv, prefill = rng.randrange(0, 400), rng.randrange(0, 900_000), rng.choice((0, 0, 37, 512))
        budget = rng.uniform(0.002, 0.08)
        cap = rng.choice((1, 64, 2048, 8192))
        expected = largest_chunk(PredictOnly(), budget, decodes, kv + prefill, cap, prefill)
        assert largest_chunk(roofline, budget, decodes, kv + prefill, cap, prefill) == expected
        root = roofline.chunk_within(budget, prefill, decodes, kv + prefill)
        assert root == 0.0 or abs(min(root, cap) - expected) <= 1 or expected == cap


def test_largest_chunk_from_the_online_fits_root_equals_the_binary_search():
    """An online fit over the roofline solves for the chunk too (each of its terms is a quadratic in the chunk):
    the search from its root lands where bisection over its predict does, before any step (the prior alone) and
    after steps that make it fit a slower machine with a different shape."""
    from scheduler.online_fit import OnlineChunkSolvingModel, online_latency_model
    from scheduler.types import StepStats

    roofline = RooflineLatencyModel(H200_SXM, LLAMA_3_1_8B)
    online = online_latency_model(roofline, max_prefill_tokens=2048)
    assert isinstance(online, OnlineChunkSolvingModel)

    class PredictOnly:
        predict = staticmethod(online.predict)

    rng = random.Random(11)

    def check(rounds: int) -> None:
        for _ in range(rounds):
            decodes, kv, prefill = rng.randrange(0, 400), rng.randrange(0, 900_000), rng.choice((0, 0, 37, 512))
            budget = rng.uniform(0.002, 0.2)
            cap = rng.choice((1, 64, 2048, 8192))
            expected = largest_chunk(PredictOnly(), budget, decodes, kv + prefill, cap, prefill)
            assert largest_chunk(online, budget, decodes, kv + prefill, cap, prefill) == expected

    check(1500)
    for _ in range(300):  # a machine 1.6x slower per prefill token, with 2 ms of host time per step
        p, d, k = rng.randrange(0, 2048), rng.randrange(0, 256), rng.randrange(0, 500_000)
        duration = 1.3 * roofline.predict(p, d, k) + 0.6 * p * 1.5e-5 + 0.002
        online.observe(StepStats(start=0.0, duration=duration, num_prefill_tokens=p, num_decode_seqs=d,
                                 num_kv_tokens=k, num_blocks_used=0, num_running=d, num_waiting=0))
    coefficients = online.coefficients()
    assert coefficients[0] > 0 and coefficients[1] > 0  # the fit moved off the prior: a real test of its terms
    check(1500)

    class Plain:  # a prior that does not solve for its chunk: the fit over it does not claim to
        predict = staticmethod(roofline.predict)

    assert not isinstance(online_latency_model(Plain()), OnlineChunkSolvingModel)
