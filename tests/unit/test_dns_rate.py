"""The resolver's per-sandbox rate limit (dsecd/net/dns.py RateLimiter)."""

from dsecd.net.dns import RateLimiter


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_of_twice_the_rate_then_the_rate():
    clock = Clock()
    lim = RateLimiter(5, clock)
    assert [lim.allow("10.88.1.2") for _ in range(12)] == [True] * 10 + [False] * 2
    clock.now += 1.0                                     # 5 tokens back
    assert [lim.allow("10.88.1.2") for _ in range(6)] == [True] * 5 + [False]


def test_each_source_has_its_own_bucket():
    lim = RateLimiter(1, Clock())
    assert [lim.allow("10.88.1.2") for _ in range(3)] == [True, True, False]
    assert lim.allow("10.88.1.3")


def test_rate_zero_is_no_limit():
    lim = RateLimiter(0, Clock())
    assert all(lim.allow("10.88.1.2") for _ in range(10_000)) and len(lim) == 0


def test_prune_forgets_only_the_sources_whose_bucket_is_full_again():
    clock = Clock()
    lim = RateLimiter(10, clock)
    lim.allow("a")
    for _ in range(20):
        lim.allow("b")
    clock.now += 0.5                 # a: full again (1 token used, 5 back); b: 5 of 20 back
    lim.prune()
    assert len(lim) == 1
    assert [lim.allow("b") for _ in range(6)] == [True] * 5 + [False]
