"""The CPU KV cache advised into transparent huge pages (``huge_pages``), where Linux has them.

The tests check the advice itself (the ``hg`` flag on the cache's mappings in /proc/self/smaps), which is
deterministic; whether the kernel then finds free 2 MB pages depends on the machine's memory, and the speed it
buys is measured in ``huge_pages``' docstring, not here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nxdserve.engine.models import huge_pages
from nxdserve.engine.models.attention import SlotKVCache

HUGE = 2 << 20


def _thp_mode() -> str | None:
    """The bracketed choice of ``always [madvise] never``, or None where there is no THP."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not path.exists():
        return None
    text = path.read_text()
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


def _advised(lo: int, hi: int) -> list[bool]:
    """For each mapping that overlaps [lo, hi): whether it carries the huge-page advice (VmFlags ``hg``)."""
    flags, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            start, end = (int(v, 16) for v in head[0].split("-"))
            inside = start < hi and end > lo
        elif inside and head and head[0] == "VmFlags:":
            flags.append("hg" in head[1:])
    return flags


def _interior(t: torch.Tensor) -> tuple[int, int]:
    """The whole 2 MB pages inside ``t``'s memory."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    return -(-start // HUGE) * HUGE, end // HUGE * HUGE


def _cache() -> SlotKVCache:  # 32 MB
    return SlotKVCache(4, 8, 2, 1024, 64, torch.bfloat16, torch.device("cpu"))


needs_thp = pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")


@needs_thp
def test_kv_cache_is_zeroed_and_advised_into_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "enabled", True)
    cache = _cache()
    assert not cache.data.any()
    flags = _advised(*_interior(cache.data))
    assert flags and all(flags)


def test_switched_off_no_advice_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    # (Whether memory carries old advice cannot be checked here: malloc may hand back a range advised before.)
    monkeypatch.setattr(huge_pages, "enabled", False)
    assert not huge_pages.advise(torch.empty(4 * HUGE, dtype=torch.uint8))


def test_advice_is_not_given_where_it_cannot_apply() -> None:
    assert not huge_pages.advise(torch.zeros(16))  # smaller than one huge page
    if torch.cuda.is_available():
        assert not huge_pages.advise(torch.zeros(1 << 22, device="cuda"))
