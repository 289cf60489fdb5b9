"""``python -m nxdserve.bench``: the same as ``nxdserve bench``."""

from nxdserve.bench.cli import main

raise SystemExit(main())
