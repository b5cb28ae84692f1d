"""``python -m zstore.cli``: the same as the ``zstore`` command."""

import sys

from zstore.cli._main import main

sys.exit(main())
