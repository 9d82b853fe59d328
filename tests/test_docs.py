"""The docs cannot drift from the CLIs: every fenced shell command in README.md and docs/ that runs
a project entry point (``python -m <package module>``, ``tools/*.py``, ``bench/*/*.py``, ``scripts/*.py``, torchrun
or deepspeed around one) names only flags that entry point's ``--help`` lists, and every
``eagle3-run --config-name`` names a recipe that exists. The README stays a user's guide."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PACKAGES = ("eagle3", "data_gen", "serve_eval", "hard_mining", "recipes")


def shell_commands(page: Path) -> list[tuple[str, str]]:
    """(where, command) for each command of the page's bash/sh/shell fences, continuation lines joined."""
    out = []
    fence = None
    lines = page.read_text(encoding="utf-8").splitlines()
    pending, start = "", 0
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence not in ("bash", "sh", "shell", "console"):
            continue
        text = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not pending:
            start = n
        pending += text.rstrip("\\").rstrip() + " "
        if not text.endswith("\\"):
            if pending.strip():
                out.append((f"{page.name}:{start}", pending.strip().lstrip("$ ")))
            pending = ""
    return out


def entry_point(tokens: list[str]) -> tuple[str, str, list[str]] | None:
    """("module"|"script", name, the arguments after it) for a command that runs a project entry point."""
    for i, tok in enumerate(tokens):
        if tok in ("-m", "--module") and i + 1 < len(tokens) and tokens[i + 1].split(".")[0] in PACKAGES:
            return "module", tokens[i + 1], tokens[i + 2:]
        if re.fullmatch(r"(\./)?(bench/\w+|tools|scripts|scripts/ci)/\w+\.py", tok):
            return "script", tok, tokens[i + 1:]
    return None


@cache
def help_text(kind: str, name: str) -> str:
    """What ``--help`` prints, run in this process (runpy, as ``python -m`` / ``python file`` would)."""
    argv, buffer = sys.argv, io.StringIO()
    sys.argv = [name, "--help"]
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()):
            try:
                if kind == "module":
                    runpy.run_module(name, run_name="__main__", alter_sys=True)
                else:  # `python file` puts the file's folder first on sys.path: its siblings import
                    sys.path.insert(0, str((REPO / name).parent))
                    runpy.run_path(str(REPO / name), run_name="__main__")
            except SystemExit:
                pass
    finally:
        sys.argv = argv
        if kind != "module" and sys.path and sys.path[0] == str((REPO / name).parent):
            sys.path.pop(0)
    return buffer.getvalue()


def flags(args: list[str]) -> list[str]:
    """The ``--flags`` a command passes, brackets and ``=values`` of optional syntax stripped."""
    out = []
    for tok in args:
        tok = tok.strip("[]")
        if tok.startswith("--") and len(tok) > 2:
            out.append(tok.split("=")[0].split("]")[0])
    return out


COMMANDS = [(where, cmd) for page in PAGES for where, cmd in shell_commands(page)]


def test_the_readme_is_a_users_guide() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; reference pages go to docs/"
    for link in re.findall(r"\]\((docs/[^)#]+)", "\n".join(lines)):
        assert (REPO / link).is_file(), link


def test_the_docs_show_commands_of_every_stage() -> None:
    def tokens(cmd: str) -> list[str]:
        parts = shlex.split(cmd)
        return shlex.split(parts[2].split("&&")[-1]) if parts[:2] == ["bash", "-c"] else parts

    shown = {entry_point(tokens(cmd))[1] for _, cmd in COMMANDS if entry_point(tokens(cmd))}
    for module in ("data_gen.pools", "data_gen.regenerate", "data_gen.harvest", "eagle3.train", "eagle3.export",
                   "hard_mining.rounds", "serve_eval.evaluate", "serve_eval.server", "tools/gpu_check.py"):
        assert module in shown, module


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_names_flags_its_entry_point_has(where: str, command: str) -> None:
    tokens = shlex.split(command)
    if tokens[:2] == ["bash", "-c"]:  # a subshell: its last command
        tokens = shlex.split(tokens[2].split("&&")[-1])
    if "eagle3-run" in tokens[:3] or any(t.endswith("/eagle3-run") for t in tokens[:3]):
        for i, tok in enumerate(tokens):
            if tok == "--config-name":
                assert (REPO / "recipes" / f"{tokens[i + 1]}.yaml").is_file(), f"{where}: no recipe {tokens[i + 1]}"
        return
    found = entry_point(tokens)
    if found is None:
        pytest.skip("not a project entry point")
    kind, name, args = found
    if kind == "script" and not (REPO / name).is_file():
        pytest.fail(f"{where}: {name} does not exist")
    if args[:1] == ["verify"] and name in ("data_gen.harvest", "data_gen.harvest"):
        return  # `harvest verify <store>`: a positional subcommand, no flags
    try:
        text = help_text(kind, name)
    except ImportError as err:  # an optional tool's venv (vLLM, speculators)
        if err.name and err.name.split(".")[0] in ("vllm", "speculators"):
            pytest.skip(f"{name} needs {err.name}")
        raise
    assert "usage:" in text, f"{where}: {name} --help printed no usage"
    missing = [f for f in flags(args) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    assert not missing, f"{where}: {name} has no {', '.join(missing)}"


SOURCE_DIRS = ("eagle3", "data_gen", "hard_mining", "serve_eval", "recipes", "tools", "bench", "scripts", "tests",
               "docs")
"""Where a path a page names may be relative to (a package's own files are named from inside it)."""


def named_paths(text: str) -> list[str]:
    """The repository files a page names in backticks (``eagle3/train/size.py``, ``scripts/test.sh``,
    ``families/dflash.py``): a token with a known extension and no placeholder, output folder or URL."""
    out = []
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.split(":")[0].split("#")[0].rstrip(".,;)")
        if (re.fullmatch(r"[\w./-]+\.(py|sh|yaml|md|toml|lock|j2)", token) and "/" in token
                and not token.startswith(("runs/", "/", "~", ".venv", "http", "..", "$")) and "NAME" not in token
                and "<" not in token):
            out.append(token)
    return out


def missing_paths(text: str, folder: Path) -> list[str]:
    """The files ``text`` (a page in ``folder``) names that exist nowhere they could be relative to."""
    bases = (REPO, folder, *(REPO / d for d in SOURCE_DIRS), REPO / "eagle3" / "draft", REPO / "eagle3" / "store")
    ours = [p for p in named_paths(text)  # in a folder of ours (not a run's output, not another project's file)
            if any((base / p.split("/")[0]).is_dir() for base in bases)]
    return [p for p in ours if not any((base / p).exists() for base in bases)]


HISTORY = ("experiments.md", "benchmarks.md")
"""The dated logs: they name the files of their day."""


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in HISTORY],
                         ids=[p.name for p in PAGES if p.name not in HISTORY])
def test_every_file_a_page_names_exists(page: Path) -> None:
    missing = missing_paths(page.read_text(encoding="utf-8"), page.parent)
    assert not missing, f"{page.name} names files that do not exist: {missing}"


def test_the_path_check_catches_a_file_that_does_not_exist() -> None:
    """The negative control: a page naming a moved file fails the check above; outputs are not files of ours."""
    text = ("`train/plan.py`, `eagle3/train/size.py`, `families/dflash.py`, `runs/x/y.py`, `scripts/gone.sh`, "
            "`eval/report.md`, `vllm/config/speculative.py`")
    assert missing_paths(text, REPO / "docs") == ["train/plan.py", "scripts/gone.sh"]
