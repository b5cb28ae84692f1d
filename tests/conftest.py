"""Shared fixtures: small real HDF5 files written by h5py, converted stores, cache dirs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

import zstore
from zstore.synthetic import SyntheticSpec, make_synthetic

SMALL = SyntheticSpec(items=6, mics=2, speakers=2, min_seconds=3.0, max_seconds=12.0, seed=1)
RATES = {"wav": 16000, "act": 100}
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def small_h5(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("h5") / "small.h5"
    make_synthetic(path, SMALL)
    return str(path)


@pytest.fixture(scope="session")
def small_store(small_h5: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The one-group-per-item layout (SMALL's items of 3-12 s would mostly be packed by
    default; ``packed_store`` holds them packed)."""
    dst = tmp_path_factory.mktemp("store") / "small.zarr"
    zstore.convert(small_h5, dst, rates=RATES, workers=1, progress=False, pack_seconds=0)
    return str(dst)


@pytest.fixture(scope="session")
def packed_store(small_h5: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """SMALL's items packed (``pack_seconds`` above the longest)."""
    dst = tmp_path_factory.mktemp("store") / "packed.zarr"
    zstore.convert(small_h5, dst, rates=RATES, workers=1, progress=False, pack_seconds=60)
    return str(dst)


@pytest.fixture
def cache(tmp_path: Path) -> zstore.CacheConfig:
    return zstore.CacheConfig(
        ram_dir=tmp_path / "ram", ram_bytes="256MB", ssd_dir=tmp_path / "ssd", ssd_bytes="256MB"
    )


@pytest.fixture(autouse=True)
def _no_user_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Tests never touch the user's real cache directories: the default SSD tier goes
    under a temporary XDG_CACHE_HOME, and the default RAM tier (``/dev/shm/zstore-<uid>``,
    the node's real one) to a directory of the test's own on the same tmpfs, removed
    after it; subprocesses inherit both.  A test of the defaults themselves unsets
    ZSTORE_RAM_DIR."""
    for var in (
        "ZSTORE_RAM_BYTES",
        "ZSTORE_RAM_DIR",
        "ZSTORE_RAM_FORMAT",
        "ZSTORE_SSD_BYTES",
        "ZSTORE_SSD_DIR",
        "ZSTORE_FETCH",
        "ZSTORE_MAX_REQUESTS",
        "ZSTORE_FILLS",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    ram = (
        Path(tempfile.mkdtemp(prefix="zstore-test-", dir="/dev/shm"))
        if os.path.isdir("/dev/shm")
        else tmp_path / "ram-default"
    )
    monkeypatch.setenv("ZSTORE_RAM_DIR", str(ram))
    _RAM_DIRS.append(ram)
    try:
        yield
    finally:
        shutil.rmtree(ram, ignore_errors=True)


#: The tests' default RAM tiers, removed again when the session ends: a fill behind a
#: test's reads can still put a shard after the test has removed its directory.
_RAM_DIRS: list[Path] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for ram in _RAM_DIRS:
        shutil.rmtree(ram, ignore_errors=True)


def write_h5(
    path: Path | str,
    items: dict[str, dict[str, np.ndarray]],
    attrs: dict[str, dict[str, object]] | None = None,
) -> str:
    """Write ``{group: {dataset: array}}`` to an HDF5 file."""
    with h5py.File(path, "w") as f:
        for group, arrays in items.items():
            g = f.require_group(group)
            for name, data in arrays.items():
                g.create_dataset(name, data=data)
            for k, v in (attrs or {}).get(group, {}).items():
                g.attrs[k] = v
    return str(path)


def same_layout_sources(where: Path, items: int = 4, seconds: int = 30) -> list[str]:
    """Two HDF5 files (a.h5, b.h5) of the same items and shapes whose ``wav`` values
    differ (all >= 1000/32768 in a, >= -2000/32768 in b) but compress to the same sizes,
    so one store's shard indexes fit the other's objects byte for byte."""
    paths = []
    for name, level in (("a.h5", 1000), ("b.h5", -2000)):
        with h5py.File(Path(where) / name, "w") as f:
            for i in range(items):
                wave = level + (np.arange(16000 * seconds) % 7)
                f[f"rec{i}/wav"] = (wave[None] / 32768).astype(np.float32)
        paths.append(str(Path(where) / name))
    return paths


def wait_until(proc, ready) -> None:
    """Return once ``ready()`` holds or ``proc`` has ended: checked whenever the process
    has run a little longer (waking at once if it exits)."""
    import subprocess

    while proc.poll() is None and not ready():
        try:
            proc.wait(timeout=0.02)
        except subprocess.TimeoutExpired:
            pass


def kill_when(proc, ready) -> None:
    """SIGKILL ``proc`` once ``ready()`` holds: checked whenever the process has run a
    little longer (waking at once if it exits), then waited for."""
    import signal

    try:
        wait_until(proc, ready)
        if proc.poll() is not None:  # it ended on its own: the test cannot kill it midway
            pytest.fail(f"{proc.args[:4]} ended (exit {proc.returncode}) before it was killed")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


PYTHON = sys.executable
STACK_DUMPS = Path(__file__).resolve().parent / "stack_dumps"  # its sitecustomize.py


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_or_dump(
    cmd: list[str], env: dict[str, str], timeout: float, stacks: Path
) -> subprocess.CompletedProcess:
    """Run ``cmd`` like ``subprocess.run(..., capture_output=True, text=True)``; if it is
    still running after ``timeout`` seconds, fail the test with every process's output
    and the stacks of all their threads (written to ``stacks`` on SIGUSR1), then kill
    them all: a hang then says where each process waited (pytest-timeout would kill
    the test with the children's output lost)."""
    import psutil

    stacks.mkdir(parents=True, exist_ok=True)
    env = dict(env)
    env["ZSTORE_TEST_STACKS"] = str(stacks)
    env["PYTHONPATH"] = str(STACK_DUMPS) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        pass
    # every process of the run's session: the ones that outlived it too (an output pipe
    # held open by one of them keeps communicate() waiting after the run has ended)
    tree = []
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(p.pid) == proc.pid:
                tree.append(p)
    ended = proc.poll()  # None: the run itself is still going
    names = {}
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            names[p.pid] = " ".join(p.cmdline()[:6])
            p.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 30  # each process writes its dump when signalled
    waiting = {p.pid for p in tree}
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)  # a dump is written at once, in pieces: look once they are out
        waiting = {
            pid
            for pid in waiting
            if _alive(pid)
            and not ((stacks / f"{pid}.txt").exists() and (stacks / f"{pid}.txt").stat().st_size)
        }
    for p in reversed(tree):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    out, err = proc.communicate()
    dumps = "\n".join(
        f"--- process {pid} ({name}):\n"
        + ((stacks / f"{pid}.txt").read_text() if (stacks / f"{pid}.txt").exists() else "")
        for pid, name in names.items()
    )
    pytest.fail(
        f"{cmd[:6]} still running after {timeout:.0f} s (its exit status: {ended}; None:"
        f" it had not ended, else a process it started held its output)\n"
        f"stdout:\n{out}\nstderr:\n{err}\nstacks:\n{dumps}",
        pytrace=False,
    )


class CountingApp:
    """WSGI middleware: counts requests per method and path at the S3 server."""

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        #: (path, Range header) of each GET that named a range
        self.ranges: list[tuple[str, str]] = []

    def __call__(self, environ, start_response):
        with self.lock:
            self.requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")))
            if environ["REQUEST_METHOD"] == "GET" and environ.get("HTTP_RANGE"):
                self.ranges.append((environ.get("PATH_INFO", ""), environ["HTTP_RANGE"]))
        return self.app(environ, start_response)

    def chunk_gets(self) -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if m == "GET" and "/c/" in p)


@pytest.fixture(scope="module")
def s3():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    counter = CountingApp(server._server.app)
    server._server.app = counter
    host, port = server.get_host_and_port()
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"},
    }
    import boto3

    boto3.client(
        "s3",
        endpoint_url=f"http://{host}:{port}",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket="zstore-test")
    yield options, counter
    server.stop()


@pytest.fixture(scope="module")
def s3_store(s3, small_h5):
    """small_h5 converted onto the module's S3 endpoint."""
    options, _ = s3
    url = "s3://zstore-test/small.zarr"
    report = zstore.convert(
        small_h5,
        url,
        rates=RATES,
        storage_options=options,
        workers=2,
        progress=False,
        verify=True,
        pack_seconds=0,  # as small_store (packed on S3: tests/convert/test_packed.py)
    )
    assert report.items == 6 and report.verified
    return url


def manifest_of(store):
    """The store's manifest, as readers see it, with the store's history (its sources,
    appended files, what was left out) in ``extra`` as the converter reads it."""
    from zstore.format.manifest import read_manifest

    return read_manifest(str(store), None, history=True)[0]


def edit_header(store, edit) -> None:
    """Change the root header of a store (``edit(header) -> header``), as another tool
    writing the store would."""
    import zarr

    from zstore.format.layout import MANIFEST_ATTR

    root = zarr.open_group(str(store), mode="r+", use_consolidated=False)
    root.attrs[MANIFEST_ATTR] = edit(dict(root.attrs[MANIFEST_ATTR]))


# -- helpers the tests share --------------------------------------------------------


def zstore_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "zstore.cli", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "zstore.cli", *args],
        env=env or subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
        **kw,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)


def corpus_files(tmp_path):
    """Three HDF5 files under tmp_path/corpus (two with the same group name, one nested)."""
    rng = np.random.default_rng(1)

    def make(n):
        return {
            "wav": rng.standard_normal((1, n * 160)).astype(np.float32),
            "act": (rng.random((2, n)) > 0.5).astype(np.float32),
        }

    (tmp_path / "corpus" / "day2").mkdir(parents=True)
    a = {"rec0": make(300), "rec1": make(400)}
    b = {"rec0": make(350)}  # the same group name as in a.h5
    c = {"spk/rec9": make(500)}
    write_h5(tmp_path / "corpus" / "a.h5", a)
    write_h5(tmp_path / "corpus" / "b.hdf5", b)
    write_h5(tmp_path / "corpus" / "day2" / "c.h5", c)
    return {"a": a, "b": b, "c": c}


@pytest.fixture
def every_stripe_held():
    """``every_stripe_held(locks)``: holds every stripe of a ``StripedLocks`` on
    descriptors of its own (as another process would: ``flock`` excludes other
    descriptors of the same process too) until the test ends, or until the function
    it returns is called."""
    import fcntl

    fds: list[int] = []

    def release() -> None:
        while fds:
            os.close(fds.pop())

    def hold(locks):
        assert locks._safe()
        for stripe in range(locks.stripes):
            fd = locks._open(stripe)
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return release

    yield hold
    release()


@pytest.fixture
def hold(monkeypatch):
    """``hold(cls, name)``: calls of that method wait for the ``release`` event it
    returns with the ``started`` event each call sets (released at teardown too)."""
    releases = []

    def holding(cls, name):
        started, release = threading.Event(), threading.Event()
        real = getattr(cls, name)

        def held(self, *args, **kwargs):
            started.set()
            assert release.wait(120)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, held)
        releases.append(release)
        return started, release

    yield holding
    for release in releases:
        release.set()
