"""Every command the README and docs/*.md tell a user to type names something that exists (issue 37,
item 6): a make target of the Makefile, an ``rft`` command with its options (read from the typer app
of ``flows/cli.py``, nothing is run), a Prefect deployment of ``prefect.yaml``, or a file of this
repository (a script, a ``python -m`` module, a config, a test).

Commands are taken from fenced ``bash``/``sh``/``shell``/``console`` blocks (continued lines joined,
comments dropped, split at ``&&``, ``||``, ``;``, ``|`` and ``&``) and from inline code spans that
begin with ``make `` or ``rft `` (or ``.venv/bin/rft ``). A program this project does not ship
(``git``, ``pip``, ``prefect`` outside ``deployment run``, ...) must be in ``EXTERNAL``; an argument of
any command that names a path under one of the repository's folders (``configs/...``,
``benchmarks/...``) must exist. Placeholders (``…``, ``<run>``, ``*``, ``{...}``) are never paths.
"""
from __future__ import annotations

import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest
import typer
import yaml

from flows.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
# programs this project does not ship, which a page may tell a user to run
EXTERNAL = {"cd", "cp", "export", "source", "git", "pip", "nvidia-smi", "prefect", "tensorboard", "hf", "srun",
            "torchrun", "ray", "duckdb", "curl"}
# the repository's folders: an argument under one of them is a path that must exist
REPO_DIRS = ("configs/", "benchmarks/", "examples/", "tests/", "docs/", "flows/", "rft_core/", "schemas/", "tasks/")
PLACEHOLDER = re.compile(r"[…<>*{}]")
INLINE = re.compile(r"`((?:\.venv(?:-gpu)?/bin/)?(?:rft|make) [^`]+)`")
PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")


def _lines_to_commands(lines: list[tuple[int, str]]) -> list[tuple[int, list[str]]]:
    """(line, tokens) of each simple command in shell lines (continuations joined, comments dropped)."""
    out, joined, start = [], "", None
    for lineno, line in lines:
        start = lineno if start is None else start
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        lexer = shlex.shlex(joined + line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        tokens = list(lexer)
        joined, first = "", start
        start = None
        command: list[str] = []
        for tok in tokens + [";"]:
            if tok in SEPARATORS:
                if command:
                    out.append((first, command))
                command = []
            else:
                command.append(tok)
    return out


def page_commands(text: str) -> list[tuple[int, list[str]]]:
    """(1-based line, tokens) of every command of a markdown page: fenced shell blocks and inline spans."""
    shell, fence, lang = [], None, ""
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if fence is None:
                fence, lang = len(line) - len(line.lstrip()), stripped[3:].strip().lower()
            else:
                fence = None
            continue
        if fence is not None:
            if lang in SHELL_LANGS:
                shell.append((lineno, line[fence:]))
            continue
        for m in INLINE.finditer(line):
            shell.append((lineno, m.group(1)))
    return _lines_to_commands(shell)


@lru_cache(maxsize=None)
def make_targets() -> frozenset[str]:
    """The targets of the Makefile (rules and .PHONY names; variables and pattern rules left out)."""
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\- ]+):(?![:=])(.*)$", line)
        if not m:
            continue
        if m.group(1).strip() == ".PHONY":
            targets.update(m.group(2).split())
        else:
            targets.update(m.group(1).split())
    return frozenset(targets - {".PHONY"})


@lru_cache(maxsize=None)
def deployments() -> dict[str, str]:
    """prefect.yaml's deployments: name -> entrypoint (``file.py:function``)."""
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return {d["name"]: d["entrypoint"] for d in spec["deployments"]}


def _path_problems(args: list[str]) -> list[str]:
    """Arguments (or ``KEY=value`` / ``--opt=value`` values) under a repository folder that do not exist."""
    bad = []
    for arg in args:
        value = arg.split("=", 1)[1] if "=" in arg else arg
        if value.startswith(REPO_DIRS) and not PLACEHOLDER.search(value) and not (ROOT / value).exists():
            bad.append(f"no such file in the repository: {value}")
    return bad


def _make_problems(args: list[str]) -> list[str]:
    return [f"no make target {a!r} (Makefile targets: {', '.join(sorted(make_targets()))})"
            for a in args if "=" not in a and not a.startswith("-") and a not in make_targets()]


def _rft_problems(args: list[str]) -> list[str]:
    cmd = typer.main.get_command(app)  # typer's own click (typer._click in typer 0.29): duck-typed, a group has .commands
    path = ["rft"]
    rest = list(args)
    while hasattr(cmd, "commands") and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        if name not in cmd.commands:
            return [f"no command {' '.join(path + [name])!r} (commands of {' '.join(path)}: {', '.join(sorted(cmd.commands))})"]
        cmd, path = cmd.commands[name], path + [name]
    if hasattr(cmd, "commands") and "--help" not in rest:
        return [f"{' '.join(path)} needs a command: {', '.join(sorted(cmd.commands))}"]
    known = {"--help"} | {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
    bad = [f"{' '.join(path)} has no option {a.split('=')[0]!r} (options: {', '.join(sorted(known))})"
           for a in rest if a.startswith("-") and a != "-" and a.split("=")[0] not in known]
    return bad


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__main__.py") if p.is_file()), None)


def _python_problems(args: list[str]) -> list[str]:
    rest = list(args)
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        rest.pop(0)  # interpreter options
    if not rest:
        return []
    if rest[0] == "-m":
        module = rest[1] if len(rest) > 1 else ""
        if (ROOT / module.split(".")[0]).is_dir() and _module_file(module) is None:
            return [f"no module {module!r} in the repository (python -m needs {module.replace('.', '/')}.py "
                    f"or {module.replace('.', '/')}/__main__.py)"]
        return []  # pytest, venv, pip: installed modules
    script = rest[0]
    if not script.startswith("/") and not (ROOT / script).is_file():
        return [f"no script {script!r} in the repository"]
    return []


def _prefect_problems(args: list[str]) -> list[str]:
    if args[:2] != ["deployment", "run"] or len(args) < 3:
        return []
    flow, _, name = args[2].partition("/")
    if name not in deployments():
        return [f"no deployment {name!r} in prefect.yaml (deployments: {', '.join(sorted(deployments()))})"]
    file, func = deployments()[name].split(":")
    if not re.search(rf'@flow\(name="{re.escape(flow)}"[^\n]*\)\s*\ndef {re.escape(func)}\(', (ROOT / file).read_text()):
        return [f"deployment {name!r} runs {deployments()[name]}, which is not the flow {flow!r}"]
    return []


def command_problems(tokens: list[str]) -> list[str]:
    """Why a command names nothing real ([] when it does)."""
    tokens = list(tokens)
    while tokens and (tokens[0] == "exec" or re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0])):
        tokens.pop(0)  # `exec`, environment assignments
    if not tokens:
        return []
    program, args = Path(tokens[0]).name, tokens[1:]
    if program == "make":
        found = _make_problems(args)
    elif program == "rft":
        found = _rft_problems(args)
    elif PYTHON.match(program):
        found = _python_problems(args)
    elif program == "prefect":
        found = _prefect_problems(args)
    elif program in EXTERNAL:
        found = []
    else:
        return [f"{tokens[0]!r} is no make target, rft command, repository file or known program"]
    return found + _path_problems(args)


def all_commands() -> list[tuple[str, int, list[str]]]:
    return [(str(p.relative_to(ROOT)), line, toks) for p in DOCS for line, toks in page_commands(p.read_text())]


def test_the_extractor_on_a_hand_made_page():
    page = ("text `rft check RUN` and `make demo CONFIG=configs/grpo_demo.yaml` here, `rft_core/x.py` not\n"
            "```bash\n"
            ".venv/bin/rft train -c configs/grpo_demo.yaml \\\n"
            "    --set iterations=4   # a comment with `make nothing`\n"
            "cd x && make test; prefect server start &\n"
            "```\n"
            "```python\nmake_it()\n```\n"
            "```\nmake not-a-shell-block\n```\n"
            "1. a list\n\n   ```bash\n   python -m rft_core.stages --help\n   ```\n")
    assert page_commands(page) == [
        (1, ["rft", "check", "RUN"]), (1, ["make", "demo", "CONFIG=configs/grpo_demo.yaml"]),
        (3, [".venv/bin/rft", "train", "-c", "configs/grpo_demo.yaml", "--set", "iterations=4"]),
        (5, ["cd", "x"]), (5, ["make", "test"]), (5, ["prefect", "server", "start"]),
        (16, ["python", "-m", "rft_core.stages", "--help"]),
    ]


def test_makefile_targets_and_cli_are_read():
    assert {"demo", "test", "install-gpu", "check-gpu-deps", "test-upstream", "test-faults-all"} <= make_targets()
    assert not make_targets() & {"PY", "VENV", "STAMP", "$(STAMP)", ".PHONY"}
    assert command_problems(["rft", "data", "check", "-c", "configs/grpo_demo.yaml"]) == []
    assert set(deployments()) == {"grpo-demo", "grpo-nightly", "replay", "eval"}


@pytest.mark.parametrize("command, fault", [
    ("make deploy-everything", "no make target 'deploy-everything'"),
    ("make demo CONFIG=configs/no_such_preset.yaml", "no such file in the repository: configs/no_such_preset.yaml"),
    (".venv/bin/rft trian -c configs/grpo_demo.yaml", "no command 'rft trian'"),
    ("rft data fix data/train.jsonl", "no command 'rft data fix'"),
    ("rft data", "rft data needs a command"),
    ("rft train --config configs/grpo_demo.yaml --turbo", "rft train has no option '--turbo'"),
    ("rft inspect runs/x --iteration=2 --samples=3 --sampel 7", "rft inspect has no option '--sampel'"),
    (".venv/bin/python benchmarks/no_such_bench.py --fast", "no script 'benchmarks/no_such_bench.py'"),
    ("python -m rft_core.no_such_module --help", "no module 'rft_core.no_such_module'"),
    ("prefect deployment run 'rft-train-preset/grpo-weekly'", "no deployment 'grpo-weekly'"),
    ("prefect deployment run 'rft-eval-preset/grpo-demo'", "which is not the flow 'rft-eval-preset'"),
    ("frobnicate --all configs/grpo_demo.yaml", "'frobnicate' is no make target"),
    ("git clone x && make tset", "no make target 'tset'"),
])
def test_a_made_up_command_is_caught(command, fault):
    found = [p for _, toks in page_commands(f"```bash\n{command}\n```\n") for p in command_problems(toks)]
    assert any(fault in p for p in found), found


@pytest.mark.parametrize("command", [
    "make demo CONFIG=configs/grpo_demo.yaml", ".venv-gpu/bin/rft train -c configs/grpo_demo.yaml --set x=1 --run-root=r",
    "rft inspect runs/x -i 1 -n 5 --stage rollout --export r.jsonl", "rft serve --help", "rft data --help",
    "python3 -m rft_core.stages --help", "python -m pytest -q tests/test_docs_claims.py",
    "PY=python3.12 make install-gpu", "prefect deployment run 'rft-replay-preset/replay' --watch",
])
def test_a_real_command_passes(command):
    assert [command_problems(toks) for _, toks in page_commands(f"```bash\n{command}\n```\n")] != []
    assert all(command_problems(toks) == [] for _, toks in page_commands(f"```bash\n{command}\n```\n"))


def test_the_pages_have_commands_of_every_kind():
    programs = [Path(toks[0]).name for _, _, toks in all_commands()]
    assert len(programs) >= 60, programs  # the check is not vacuous
    assert {"make", "rft", "prefect", "python"} <= set(programs)
    readme = [toks for doc, _, toks in all_commands() if doc == "README.md"]
    assert ["make", "demo"] in readme and ["make", "test"] in readme


@pytest.mark.parametrize("doc, line, tokens", all_commands(), ids=lambda v: str(v) if isinstance(v, (str, int)) else " ".join(v)[:50])
def test_every_command_of_the_readme_and_docs_names_something_real(doc, line, tokens):
    assert command_problems(tokens) == [], f"{doc}:{line}: {shlex.join(tokens)}"
