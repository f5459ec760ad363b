"""The command line: parsers generated from the configs (:mod:`clusterlm.cli.options`), thin command entries and
the error -> exit-code map (:mod:`clusterlm.cli.commands`); ``clusterlm`` (the console script) is :func:`main`."""

from clusterlm.cli.commands import main

__all__ = ["main"]
