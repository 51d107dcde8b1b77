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
