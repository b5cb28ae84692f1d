"""``zstore.streamcopy``: kept as an import path; the code is in
:mod:`zstore.read.streamcopy`."""

from zstore.read import copy_streamed, streaming

__all__ = ["copy_streamed", "streaming"]
