"""objectives/ and workers/ install as autotune.objectives / autotune.workers, editable and wheel."""

import subprocess
import sys
import tomllib
import zipfile

from support import REPO


def _declared_packages() -> set[str]:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(cfg["packages"])


def test_every_package_folder_is_declared():
    mapping = {"autotune": "autotune", "objectives": "autotune.objectives", "workers": "autotune.workers"}
    found = set()
    for top, name in mapping.items():
        for init in (REPO / top).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / top)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join([name, *rel.parts]))
    assert found <= _declared_packages(), f"add to pyproject packages: {sorted(found - _declared_packages())}"


def test_editable_install_imports_mapped_packages():
    code = (
        "import autotune.objectives, autotune.workers, autotune.workers.protocol, autotune.workers.hardware as h;"
        "print(len(h.available_profiles()))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert int(res.stdout.strip()) >= 4


def test_wheel_contains_and_imports_mapped_packages(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next((tmp_path / "dist").glob("autotune-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(tmp_path / "site")
    assert "autotune/workers/protocol.py" in names
    assert "autotune/objectives/__init__.py" in names
    assert any(n.startswith("autotune/workers/hardware/") and n.endswith(".yaml") for n in names)
    assert "autotune/workers/simulate/prefill_queue.json" in names  # the prefill pool's queue table
    assert not any(n.startswith(("workers/", "objectives/")) for n in names)  # no generic top-level names
    # every module of the source tree's autotune/ is in the wheel (a stage package left out of
    # pyproject's list would install a CLI that cannot import its study)
    source = {str(p.relative_to(REPO)) for p in (REPO / "autotune").rglob("*.py")}
    assert source <= names, sorted(source - names)
    code = (
        "import autotune.workers.hardware as h, autotune.objectives as o, autotune.workers as w;"
        "import autotune.cli.commands, autotune.study.search, autotune.finish.study_end;"
        "assert w.__file__.startswith(%r); print(h.available_profiles())" % str(tmp_path / "site")
    )
    res = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r});"
            "import site; site.main(); sys.path.insert(0, " + repr(str(tmp_path / "site")) + "); " + code,
        ],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    assert "ascend-910b" in res.stdout
