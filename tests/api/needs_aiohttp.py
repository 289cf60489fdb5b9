"""A module whose own import needs aiohttp (tests/api/test_cli.py: a missing dependency, not a missing module)."""

import aiohttp  # noqa: F401


def main(argv: list[str]) -> int:
    return 0
