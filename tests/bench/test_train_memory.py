"""The long-training memory measurement's arithmetic (the run itself takes minutes and is
run by hand: ``python -m bench.train_memory``)."""

from __future__ import annotations

import pytest

from bench.train_memory import figures


def test_the_slope_leaves_out_the_warm_up_and_is_in_kb_per_step() -> None:
    """A jump during the warm-up does not count; 0.5 MB a step after it is 512 KB/step,
    and the growth compares the medians of the first and the last ten steps."""
    rss = [100.0, 180.0, *[200.0 + 0.5 * i for i in range(30)]]
    result = figures(rss, warmup=2, seconds=1.0)
    assert result.slope_kb_per_step == pytest.approx(512.0)
    assert result.growth_mb == pytest.approx(10.0)
    flat = figures([300.0] * 5 + [301.0, 300.0] * 5, warmup=5, seconds=1.0)
    assert abs(flat.slope_kb_per_step) < 60


def test_too_few_steps_after_the_warm_up_is_an_error() -> None:
    """A slope needs two points."""
    with pytest.raises(ValueError, match="two steps"):
        figures([1.0, 2.0], warmup=1, seconds=0.0)
