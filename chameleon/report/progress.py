"""Progress bars on stderr, only when it is a terminal: a pipe or a log never gets tqdm's cursor escapes."""

from __future__ import annotations

import sys

from tqdm import tqdm


def on_terminal(wanted: bool = True) -> bool:
    """Whether to show progress: ``wanted``, and stderr is a terminal."""
    return wanted and sys.stderr.isatty()


def progress_bar(iterable=None, *, wanted: bool = True, **kwargs) -> tqdm:
    """A tqdm bar on stderr, disabled unless :func:`on_terminal` (``kwargs`` go to tqdm)."""
    return tqdm(iterable, file=sys.stderr, disable=not on_terminal(wanted), **kwargs)
