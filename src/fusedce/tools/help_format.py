"""The help formatter of the ``fusedce`` subcommands: argparse's defaults, said once."""
from __future__ import annotations

import argparse
import re
import textwrap


def plain(text: str) -> str:
    """``text`` without reStructuredText markup, for a terminal: ````x```` and ``:role:`x``` become ``x``."""
    text = re.sub(r":[a-z]+:`([^`]*)`", r"\1", text)
    return text.replace("``", "")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its default or X is None;
    wraps at spaces only, so that long names (``--paths`` values) stay whole; keeps a description's
    paragraphs (blank lines) apart."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return "\n\n".join(textwrap.fill(" ".join(p.split()), width, initial_indent=indent,
                                          subsequent_indent=indent, break_on_hyphens=False)
                            for p in text.split("\n\n") if p.strip())
