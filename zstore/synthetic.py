"""``zstore.synthetic``: kept as an import path; the code is in
:mod:`zstore.testing.synthetic`."""

from zstore.testing.synthetic import *  # noqa: F403
from zstore.testing.synthetic import __all__  # noqa: F401
