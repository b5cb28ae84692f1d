"""Loaded by every Python process a test starts through ``conftest.run_or_dump``: on
SIGUSR1 each one writes its threads' stacks to ``$ZSTORE_TEST_STACKS/<pid>.txt``, so a
subprocess test that hangs shows where each process of the run was waiting."""

import faulthandler
import os
import signal

_DIR = os.environ.get("ZSTORE_TEST_STACKS")


def _register() -> None:
    f = open(os.path.join(_DIR, f"{os.getpid()}.txt"), "w")  # noqa: SIM115 (kept open)
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    globals()["_file"] = f


if _DIR:
    _register()
    os.register_at_fork(after_in_child=_register)  # forked DataLoader workers: a file each
