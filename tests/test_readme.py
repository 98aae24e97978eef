"""The README works as written (issue #34): its set-up commands are the ones CI runs, every other
command in its fenced ``bash`` blocks runs (those that need no accelerator; servers are checked by
``--help`` and by resolving their arguments, not started), its spec example is a valid spec, the
flags it and docs/CLI.md name exist, it stays short, and every relative link of the README and of
``docs/*.md`` resolves.

The install and test commands are not run here: CI (``.ci/run``) runs them, and this test checks
that the README shows exactly those. The simulated main job takes a few seconds."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 150

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def fenced_blocks(text: str, lang: str) -> list[str]:
    return [body for language, body in FENCE.findall(text) if language == lang]


def commands(block: str) -> list[list[str]]:
    """Each non-empty line of a shell block as argv (comments dropped)."""
    return [argv for line in block.splitlines() if (argv := shlex.split(line, comments=True))]


def ci_commands() -> tuple[list[str], list[str]]:
    """.ci/run's install lines and test commands (its own control flow left out)."""
    install: list[str] = []
    test: list[str] = []
    section = None
    for line in CI_RUN.read_text().splitlines():
        line = line.strip()
        if line.startswith("# --- README: install"):
            section = install
        elif line.startswith("# --- README: test"):
            section = test
        elif section is test and line.startswith("if "):
            break  # the exit-status handling and the optional slow run
        elif section is not None and line and not line.startswith(("#", "set ", "rc=")):
            section.append(line)
    assert install and test, f"{CI_RUN}: no '# --- README: install/test' sections"
    return install, test


def autotune_exe() -> list[str]:
    script = Path(sys.executable).parent / "autotune"
    if script.exists():
        return [str(script)]
    found = shutil.which("autotune")
    return [found] if found else [sys.executable, "-c", "from autotune.cli.commands import main; main()"]


# ------------------------------------------------------------------------------------- set-up


def test_setup_block_is_what_ci_runs():
    """The README's first fenced block is the install line and the test line of .ci/run, byte for byte
    (the test line's commands, which .ci/run runs as separate lines to read pytest's exit status,
    joined with ``&&``)."""
    install, test = ci_commands()
    assert len(install) == 1, f".ci/run's install is one line, as the README shows it: {install}"
    first = FENCE.search(README.read_text())
    assert first and first.group(1) == "bash", "the README's first fenced block is the set-up (bash)"
    lines = [line for line in first.group(2).splitlines() if line.strip()]
    assert lines == [install[0], " && ".join(test)]


def test_step_by_step_install_is_the_install_line():
    """The README's install shown step by step runs the same commands as the one-line install."""
    (install,), _ = ci_commands()
    one_line = [shlex.split(part) for part in install.split(" && ")]
    blocks = fenced_blocks(README.read_text(), "bash")
    steps = [commands(b) for b in blocks[1:] if commands(b) and commands(b)[0] == one_line[0]]
    assert steps, "no step-by-step install block (one starting with the install line's first command)"
    assert steps[0] == one_line


# ------------------------------------------------------------------------------------- commands


def _run_dir_arg(argv: list[str], cwd: Path) -> Path:
    args = [a for a in argv[1:] if not a.startswith("-")]
    assert args, f"{shlex.join(argv)}: no run directory argument"
    return cwd / args[-1]


def test_readme_commands_run(tmp_path):
    """Every command of the README's bash blocks, in order, in a scratch working directory that sees
    the repository's files (so ``autotune_runs/`` is written there)."""
    work = tmp_path / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in ("autotune_runs", "build"):
            (work / entry.name).symlink_to(entry)
    env = {
        **os.environ,
        "COLUMNS": "120",
        "AUTOTUNE_CACHE": str(tmp_path / "cache" / "results.sqlite"),
        "AUTOTUNE_PROFILE_CACHE": str(tmp_path / "cache" / "profiles"),
    }
    exe = autotune_exe()
    (install,), _ = ci_commands()
    install_argv = [shlex.split(part) for part in install.split(" && ")]
    blocks = fenced_blocks(README.read_text(), "bash")[1:]  # the first: the set-up, run by CI
    ran = []
    for block in blocks:
        cmds = commands(block)
        if cmds and cmds[0] == install_argv[0]:
            continue  # the install step by step: checked against .ci/run above, run by CI
        for argv in cmds:
            shown = shlex.join(argv)
            if argv[:2] == ["pip", "install"]:
                continue  # an optional tool's install: not run by a test
            if argv[0] == "autotune" and argv[1:2] == ["ui"]:  # starts a server: its help, its argument
                done = subprocess.run([*exe, "ui", "--help"], cwd=work, env=env, capture_output=True, text=True)
                assert done.returncode == 0, f"autotune ui --help: {done.stderr[-2000:]}"
                assert (_run_dir_arg(argv, work) / "mlflow.db").is_file(), f"{shown}: no MLflow store there"
            elif argv[0] == "optuna-dashboard":  # starts a server: the journal it is given opens in Optuna
                import optuna
                from optuna.storages import JournalStorage
                from optuna.storages.journal import JournalFileBackend

                journal = _run_dir_arg(argv, work)
                assert journal.is_file(), f"{shown}: no such file"
                storage = JournalStorage(JournalFileBackend(str(journal)))
                assert len(optuna.get_all_study_summaries(storage)) == 1
                if shutil.which("optuna-dashboard"):
                    assert subprocess.run(["optuna-dashboard", "--help"], capture_output=True).returncode == 0
            elif argv[:2] == ["mlflow", "ui"]:
                assert subprocess.run(["mlflow", "ui", "--help"], capture_output=True).returncode == 0
            elif argv[0] == "autotune":
                done = subprocess.run([*exe, *argv[1:]], cwd=work, env=env, capture_output=True, text=True, timeout=300)
                assert done.returncode == 0, f"{shown} exited {done.returncode}:\n{done.stderr[-3000:]}"
            else:
                pytest.fail(f"the README runs {shown!r}: teach tests/test_readme.py how to check it")
            ran.append(argv[:2])
    assert ["autotune", "run"] in ran, "the README's main job was not found"


def test_readme_spec_example_is_valid(tmp_path):
    """The spec in brief is a spec autotune accepts, with every top-level section of a spec."""
    from autotune.spec.schema import Spec
    from autotune.spec.load import load_spec

    specs = [b for b in fenced_blocks(README.read_text(), "yaml") if re.search(r"^model:", b, re.M)]
    assert specs, "no spec example (a yaml block with model:) in the README"
    path = tmp_path / "brief.yaml"
    path.write_text(specs[0])
    load_spec(path)
    shown = set(re.findall(r"^([a-z_]+):", specs[0], re.M))
    sections = {name for name, field in Spec.model_fields.items() if not field.exclude}
    assert sections - shown == set(), "the spec in brief leaves out sections"


# ------------------------------------------------------------------------------------- the CLI


def _cli_options() -> dict[str, set[str]]:
    import typer

    from autotune.cli.commands import app

    group = typer.main.get_command(app)
    return {
        name: {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("-")}
        for name, cmd in group.commands.items()  # type: ignore[attr-defined]
    }


def _mentions(text: str) -> list[tuple[str, list[str]]]:
    """(command, flags) of every ``autotune CMD ...`` in a code span or a fenced line."""
    snippets = [line for body in (b for _, b in FENCE.findall(text)) for line in body.splitlines()]
    prose = FENCE.sub("", text)
    snippets += CODE_SPAN.findall(prose)
    found = []
    for snippet in snippets:
        for match in re.finditer(r"\bautotune ([a-z]+)((?: [^#]*)?)", snippet):
            flags = []
            for token in re.findall(r"--[a-z][a-z-]*(?:/--[a-z][a-z-]*)?", match.group(2)):
                flags += token.split("/")
            found.append((match.group(1), flags))
    return found


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "CLI.md"], ids=lambda p: p.name)
def test_documented_commands_and_flags_exist(page):
    options = _cli_options()
    for command, flags in _mentions(page.read_text()):
        assert command in options, f"{page.name} names `autotune {command}`, which the CLI does not have"
        missing = [f for f in flags if f not in options[command]]
        assert not missing, f"{page.name}: `autotune {command}` has no {missing}"


def test_every_backend_is_documented():
    """docs/CLI.md lists every kind ``run --backend`` takes (autotune/dispatch/backends.py); the help's own list
    is checked in tests/test_cli_help.py."""
    from autotune.spec.schema import BACKEND_KINDS
    from autotune.stacks import preset_names

    kinds = [*BACKEND_KINDS, *(n for n in preset_names() if n not in BACKEND_KINDS)]
    row = next(line for line in (ROOT / "docs" / "CLI.md").read_text().splitlines() if "`autotune run SPEC" in line)
    assert [k for k in kinds if f"`{k}`" not in row] == []


# ------------------------------------------------------------------------------------- the pages


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m) for m in re.findall(r"^#{1,6} +(.+)$", text, re.M)}


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    """Every relative link goes to a file of the repository (and its anchor to a heading there)."""
    text = FENCE.sub("", page.read_text())
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(ROOT) or not dest.exists():
            bad.append(f"{target} (no such file in the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not bad, f"{page.relative_to(ROOT)}: broken links: {bad}"
