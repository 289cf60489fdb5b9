"""Print docs/flags.md."""

from nxdserve.cli import build_parser
from nxdserve.cli_args import flags_markdown

print(flags_markdown(build_parser().flags), end="")
