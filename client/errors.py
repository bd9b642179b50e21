"""What a dpctl command raises to exit as INTERFACE.md says (client/cli.py's `_handled`)."""

from __future__ import annotations


class Failed(Exception):
    """The command ran but what it asked for failed (exit 1)."""


class BadInput(Exception):
    """Exit 2: the message names what was wrong."""
