import numpy as np

from tools.gen_tiny_model import counter_rng

PINNED_UNIFORM = [0.10671665261898111, 0.19867648607607435, 0.20556950260771245]


def test_uniform_values_are_pinned():
    # splitmix64 is integer arithmetic: these bits are the same on any machine and numpy.
    values = counter_rng.uniform(0, "pin", 3)
    assert values.tolist() == PINNED_UNIFORM


def test_element_depends_only_on_its_counter():
    whole = counter_rng.uniform(5, "stream", 10)
    tail = counter_rng.uniform(5, "stream", 4, offset=6)
    np.testing.assert_array_equal(whole[6:], tail)


def test_streams_and_seeds_differ():
    a = counter_rng.uniform(1, "a", 8)
    assert not np.array_equal(a, counter_rng.uniform(1, "b", 8))
    assert not np.array_equal(a, counter_rng.uniform(2, "a", 8))


def test_normal_has_requested_moments_and_bounded_tails():
    values = counter_rng.normal(0, "moments", (200_000,), std=0.5)
    assert values.dtype == np.float32
    assert abs(float(values.mean())) < 0.005
    assert abs(float(values.std()) - 0.5) < 0.005
    assert float(np.abs(values).max()) <= 2 * np.sqrt(3) * 0.5 + 1e-6
