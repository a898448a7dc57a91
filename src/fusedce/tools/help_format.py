"""The help formatter of the ``fusedce`` subcommands: argparse's defaults, said once."""
from __future__ import annotations

import argparse
import textwrap


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its default or X is None;
    wraps at spaces only, so that long names (``--paths`` values) stay whole."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)
