"""A figure over seeds, as the bench tables write it: the median, the range in brackets."""

from __future__ import annotations

import statistics


def spread(values: list[float], fmt: str) -> str:
    """`fmt` (a str.format pattern) of the median, then of the lowest and highest: "m [lo–hi]"."""
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} [{fmt.format(lo)}–{fmt.format(hi)}]"
