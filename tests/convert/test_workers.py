"""A conversion whose worker process dies: one clear error, and the same call again
finishes the store (nothing lost, nothing twice)."""

from __future__ import annotations

import signal
import subprocess

import psutil
import zarr
from conftest import PYTHON, kill_when, subprocess_env, wait_until
from test_convert import _completed, assert_same_as_source

from zstore.format.layout import MANIFEST_ATTR
from zstore.synthetic import SyntheticSpec, make_synthetic

CALL = "zstore.convert({src!r}, {dst!r}, rates={{'wav': 16000, 'act': 100}}, workers=2, progress=False)"


def _script(path, src, dst, guarded: bool) -> list[str]:
    call = CALL.format(src=str(src), dst=str(dst))
    lines = [call, "print('converted')"]
    body = "".join(f"\n    {line}" if guarded else f"\n{line}" for line in lines)
    path.write_text("import zstore\n" + ("if __name__ == '__main__':" if guarded else "") + body)
    return [PYTHON, str(path)]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600)


def _source(tmp_path):
    src = tmp_path / "big.h5"
    spec = SyntheticSpec(items=12, mics=8, speakers=2, min_seconds=20, max_seconds=30, seed=3)
    make_synthetic(src, spec)
    return src


def _published(dst) -> bool:
    return dst.exists() and MANIFEST_ATTR in dict(zarr.open_group(dst, mode="r").attrs)


def test_a_script_without_a_main_guard_is_told_so(tmp_path):
    src, dst = _source(tmp_path), tmp_path / "s.zarr"
    failed = _run(_script(tmp_path / "bare.py", src, dst, guarded=False))
    assert failed.returncode == 1 and "converted" not in failed.stdout
    # the workers' own tracebacks may come after the converter's (stderr is shared)
    last = [line for line in failed.stderr.splitlines() if line.startswith("zstore.errors.")][-1]
    assert last.startswith("zstore.errors.ZstoreError: a conversion worker process ended"), last
    assert "under 'if __name__ == \"__main__\":'" in last
    assert not _published(dst)
    done = _run(_script(tmp_path / "guarded.py", src, dst, guarded=True))
    assert done.returncode == 0 and "converted" in done.stdout, done.stderr
    assert_same_as_source(src, dst)


def test_a_killed_worker_is_named_and_the_same_call_finishes(tmp_path):
    src, dst = _source(tmp_path), tmp_path / "s.zarr"
    script = _script(tmp_path / "convert.py", src, dst, guarded=True)
    proc = subprocess.Popen(
        script, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    parent = psutil.Process(proc.pid)

    def kill_a_worker() -> bool:
        """Once an item is complete, SIGKILL one worker (as the out-of-memory killer
        would); the converter itself lives on."""
        if not _completed(dst):
            return False
        workers = [p for p in parent.children() if "spawn_main" in " ".join(p.cmdline())]
        if not workers:
            return False
        workers[0].send_signal(signal.SIGKILL)
        return True

    try:
        wait_until(proc, kill_a_worker)
        out, err = proc.communicate(timeout=600)
    finally:
        kill_when(proc, lambda: True) if proc.poll() is None else None
    assert proc.returncode == 1, (proc.returncode, err)
    assert "converted" not in out
    last = [line for line in err.splitlines() if line.startswith("zstore.errors.")][-1]
    assert last.startswith("zstore.errors.ZstoreError: a conversion worker process ended"), last
    assert "--workers N" in last and "the same call goes on from there" in last
    assert not _published(dst) and _completed(dst)
    done = _run(script)
    assert done.returncode == 0 and "converted" in done.stdout, done.stderr
    assert_same_as_source(src, dst)
