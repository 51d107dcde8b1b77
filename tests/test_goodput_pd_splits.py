"""The PD experiment's splits: a grid of prefill shares, then one split between each router's best and its better
neighbour."""
from bench.goodput import pd_refined_split, pd_splits


def test_the_grid_covers_each_fleet_with_at_least_one_instance_on_each_side():
    for n in (2, 8, 16, 64):
        splits = pd_splits(n)
        assert splits == sorted(set(splits)) and 1 <= splits[0] and splits[-1] <= n - 1
    assert pd_splits(64) == [24, 28, 32, 36, 40]


def test_the_refined_split_lies_between_the_best_and_its_better_neighbour():
    assert pd_refined_split({24: 1.0, 28: 5.0, 32: 4.0, 36: 2.0}) == 30
    assert pd_refined_split({24: 1.0, 28: 4.0, 32: 4.5, 36: 5.0, 40: 1.0}) == 34
    assert pd_refined_split({24: 9.0, 28: 3.0, 32: 1.0}) == 26  # the best at an edge: its one neighbour
    assert pd_refined_split({28: 4.0, 32: 6.0, 36: 6.0}) == 34  # tied best: the fewer prefill, toward the other
    assert pd_refined_split({3: 1.0, 4: 2.0, 5: 1.0}) is None  # neighbours one instance apart: nothing between
    assert pd_refined_split({4: 2.0}) is None
