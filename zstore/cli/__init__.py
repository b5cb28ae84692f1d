"""The command line: ``zstore convert | info | upgrade | cache ... | demo``.

Holds the argument parser and commands, ``store_info`` (``zstore info``), ``warm``
(``zstore cache warm``) and the demo.

May import every other layer; nothing imports it but :mod:`zstore` itself.
"""

from zstore.cli._info import store_info
from zstore.cli._main import build_parser, main
from zstore.cli.warm import warm

__all__ = ["build_parser", "main", "store_info", "warm"]
