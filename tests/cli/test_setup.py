"""The set-up script on a machine whose python3 cannot make a virtual environment."""

from __future__ import annotations

import os
import shutil
import subprocess

from conftest import REPO


def test_missing_venv_module_says_which_package_to_install(tmp_path):
    project = tmp_path / "project"
    (project / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "setup.sh", project / "tools" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", project / "pyproject.toml")
    fake = tmp_path / "bin"
    fake.mkdir()
    python3 = fake / "python3"  # a distribution python3 without its venv package
    python3.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = venv ]; then\n'
        "  echo 'The virtual environment was not created successfully "
        "because ensurepip is not available.' >&2; exit 1\n"
        "fi\nexit 0\n"
    )
    python3.chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(project / "tools" / "setup.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "apt-get install python3-venv" in proc.stderr and "ensurepip" in proc.stderr
    assert "PYTHON=" in proc.stderr  # or how to use one's own environment
    assert sorted(os.listdir(project)) == ["pyproject.toml", "tools"]  # nothing left
