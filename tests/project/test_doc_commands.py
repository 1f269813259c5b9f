"""Every command in README.md and docs/ is run as written or checked (#53): the demo and
the planner run; the GPU, benchmark and install commands are checked without running.

The commands are read from the Markdown as a reader finds them: the lines of ```bash
(sh, shell, console) blocks, indented lines that start with a command, and inline code
that does (``python -m bench moe``); ``a && b`` is two commands. A command starts with
``torchrun``, ``python``, ``pytest``, ``bash`` or ``pip`` (after ``NAME=value``
assignments and a ``.venv/bin/`` prefix). Each must match one rule below, or
`test_every_command_in_the_docs_is_known` fails, naming it:

- demo, ``torchrun --nproc-per-node N examples/train.py ...``: run, the script's `main`
  on a World of N ranks, in the doc's order, from one directory per doc (``--save ckpt``
  then ``--resume ckpt``).
- plan, ``python -m fusedpar.plan MODEL ...``: with ``--layout``, run; a search (tens of
  CPU seconds at hundreds of GPUs) runs up to the search (the arguments, the model, the
  device), the search itself being tests/plan/test_plan_time.py's.
- bench, ``python -m bench FAMILY ...``: the families exist (benchmarks take minutes,
  most need a GPU).
- pytest, ``pytest ...`` or ``python -m pytest ...``: the markers are registered, the
  files exist, ``-n`` has pytest-xdist in the test extra, each ``NAME=`` is read by the
  code (``pytest -m gpu`` needs a GPU; the whole suite is CI's).
- script, ``bash bench/gpu_run.sh STEP``: the script parses (``bash -n``) and STEP is one
  its usage line lists (it needs a GPU).
- install, ``pip install ...`` or ``python -m venv DIR``: each requirement is this
  project with extras it has, or a pin its dependencies admit (nothing is installed).
- mention, a program alone (``torchrun``, ``python -m fusedpar.plan``): it is installed.

Placeholders spelled ``path/to/...`` are filled by the test (``path/to/config.json``: a
Llama-3 8B config). The usage lines in examples/train.py's docstring (``[--moe]``
optional) are checked too: each, with and without its optional part, is a layout the
script accepts at its world size. Every ```python block parses (the complete ones run
in tests/project/test_docs.py).
"""

import ast
import contextlib
import importlib.util
import io
import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # generated/ too
PROGRAM = r"(?:[A-Z][A-Z0-9_]*=\S*\s+)*(?:\.venv/bin/)?(?:torchrun|python|pytest|bash|pip)\b"
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)  # CommonMark's code spans
PLACEHOLDERS = {"path/to/config.json": "config.json"}
LLAMA3_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
}


import train  # noqa: E402

from tests.support import demo  # noqa: E402


@dataclass(frozen=True)
class Command:
    doc: str  # "README.md", "docs/plan.md"
    text: str  # as written, one command (``a && b`` is two)

    @property
    def env(self) -> list[str]:
        """The names of the leading ``NAME=value`` assignments."""
        names = []
        for word in shlex.split(self.text):
            if not re.fullmatch(r"[A-Z][A-Z0-9_]*=\S*", word):
                break
            names.append(word.split("=")[0])
        return names

    @property
    def words(self) -> list[str]:
        """The command's words after the assignments, without a ``.venv/bin/`` prefix."""
        words = shlex.split(self.text)[len(self.env) :]
        return [words[0].removeprefix(".venv/bin/"), *words[1:]]


def _split(doc: str, text: str) -> list[Command]:
    text = " ".join(text.replace("\\\n", " ").split())
    return [Command(doc, part.strip()) for part in text.split(" && ")]


def doc_commands() -> list[Command]:
    """Every command of README.md and docs/, in order within each doc."""
    found = []
    for path in DOCS:
        doc, text = str(path.relative_to(ROOT)), path.read_text()
        for fence in FENCE.finditer(text):
            if fence[2] in ("bash", "sh", "shell", "console"):
                lines = fence[3].replace("\\\n", " ").splitlines()
                for line in lines:
                    line = line.strip().removeprefix("$ ")
                    if line and not line.startswith("#"):
                        found += _split(doc, line)
        prose = FENCE.sub("", text)
        for line in prose.splitlines():
            if re.match(rf"^ {{4,}}{PROGRAM}", line):
                found += _split(doc, line)
        for span in SPAN.finditer(prose):
            code = " ".join(span[2].split())
            if re.match(PROGRAM, code):
                found += _split(doc, code)
    return found


def header_commands() -> list[Command]:
    """examples/train.py's usage lines, each with and without its optional [parts]."""
    found = []
    for line in train.__doc__.splitlines():
        line = line.strip()
        if line.startswith("torchrun "):
            for text in (re.sub(r"\[([^]]*)\]", r"\1", line), re.sub(r"\s*\[[^]]*\]", "", line)):
                if text not in (c.text for c in found):
                    found.append(Command("examples/train.py", text))
    return found


def rule(command: Command) -> str | None:
    """The rule of the module's table that `command` falls under; None: none does."""
    words = command.words
    if len(words) == 1 or (words[:2] == ["python", "-m"] and len(words) == 3):
        return "mention"
    if words[:3] == ["python", "-m", "venv"] or words[:2] == ["pip", "install"]:
        return "install"
    if words[0] == "torchrun":
        return "demo"
    if words[:3] == ["python", "-m", "fusedpar.plan"]:
        return "plan"
    if words[:3] == ["python", "-m", "bench"]:
        return "bench"
    if words[0] == "pytest" or words[:3] == ["python", "-m", "pytest"]:
        return "pytest"
    if words[0] == "bash":
        return "script"
    return None


# --- the checks of each rule: a list of problems, empty when the command is right -----


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def check_install(command: Command) -> list[str]:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    words = command.words
    if words[:3] == ["python", "-m", "venv"]:
        return []
    project = _pyproject()["project"]
    extras = set(project["optional-dependencies"])
    pins = {canonicalize_name(Requirement(d).name): Requirement(d) for d in project["dependencies"]}
    problems = []
    for word in words[2:]:
        if word.startswith("-"):
            continue  # -e, --no-deps, --no-build-isolation
        local = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", word)
        wanted = set(local[1].split(",")) if local and local[1] else set()
        if not local:
            requirement = Requirement(word)
            name = canonicalize_name(requirement.name)
            if name == canonicalize_name(project["name"]):
                wanted = requirement.extras
            elif name not in pins:
                problems.append(f"{word}: not a dependency of {project['name']}")
            elif requirement.specifier and not any(
                pins[name].specifier.contains(str(s.version), prereleases=True)
                for s in requirement.specifier
            ):
                problems.append(f"{word}: outside the project's {pins[name]}")
        if wanted - extras:
            problems.append(
                f"{word}: no extra {sorted(wanted - extras)} (extras: {sorted(extras)})"
            )
    return problems


def _last_line(text: str) -> str:
    """argparse's error, without its usage lines."""
    return (text.strip().splitlines() or [""])[-1]


def check_demo(command: Command) -> list[str]:
    words = command.words
    if words[1] != "--nproc-per-node" or words[3] != "examples/train.py":
        return ["write it as: torchrun --nproc-per-node N examples/train.py ..."]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            train.configure(train.parse_args(words[4:]), int(words[2]))
    except (ValueError, SystemExit) as e:
        return [f"examples/train.py refuses it: {_last_line(said.getvalue() or str(e))}"]
    return []


def check_plan(command: Command) -> list[str]:
    from fusedpar.plan.__main__ import parse_args

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parse_args(command.words[3:])
    except SystemExit:
        return [f"python -m fusedpar.plan refuses its arguments: {_last_line(said.getvalue())}"]
    return []


def check_env(command: Command) -> list[str]:
    """Each ``NAME=value`` before a command names a variable the code reads."""
    if not command.env:
        return []
    code = "\n".join(
        p.read_text()
        for d in ("fusedpar", "kernels", "tests", "bench")
        for p in (ROOT / d).rglob("*.py")
    )
    return [f"{name} is read nowhere" for name in command.env if name not in code]


def check_bench(command: Command) -> list[str]:
    tree = ast.parse((ROOT / "bench" / "__main__.py").read_text())
    families = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "FAMILIES"
    )
    if command.words[3:] == ["[family", "...]"]:  # the synopsis
        return []
    unknown = [f for f in command.words[3:] if f not in families]
    return [f"no benchmark {unknown} (families: {families})"] if unknown else []


def check_pytest(command: Command) -> list[str]:
    words = command.words[1:] if command.words[0] == "pytest" else command.words[3:]
    config = _pyproject()
    markers = {m.split(":")[0] for m in config["tool"]["pytest"]["ini_options"]["markers"]}
    problems, i = [], 0
    while i < len(words):
        word = words[i]
        if word == "-m":
            names = set(re.findall(r"\w+", words[i + 1])) - {"and", "or", "not"}
            problems += [f"no marker {n!r}" for n in sorted(names - markers)]
        if word == "-n" and not any(
            d.startswith("pytest-xdist") for d in config["project"]["optional-dependencies"]["test"]
        ):
            problems.append("-n without pytest-xdist in the test extra")
        if word in ("-m", "-k", "-n", "-p", "--timeout"):
            i += 2
            continue
        if not word.startswith("-") and not (ROOT / word.split("::")[0]).exists():
            problems.append(f"no {word}")
        i += 1
    return problems


def check_script(command: Command) -> list[str]:
    script, args = ROOT / command.words[1], command.words[2:]
    if not script.is_file():
        return [f"no {command.words[1]}"]
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    if parsed.returncode:
        return [f"bash -n {command.words[1]}: {parsed.stderr}"]
    usage = re.search(r"usage: bash \S+ ([\w|]+)", script.read_text())
    if args and (usage is None or args[0] not in usage[1].split("|")):
        return [f"{args[0]} is not a step its usage line lists"]
    return []


def check_mention(command: Command) -> list[str]:
    words = command.words
    if words == ["python"] or words == ["bash"] and shutil.which("bash"):
        return []
    module = {"torchrun": "torch.distributed.run", "pytest": "pytest", "pip": "pip"}.get(words[0])
    if len(words) == 3:
        module = words[2]
        if (ROOT / module / "__main__.py").is_file():  # bench: run from the repository root
            return []
    if module is None or importlib.util.find_spec(module) is None:
        return [f"{words[0] if len(words) == 1 else module} is not installed"]
    return []


CHECKS = {
    "install": check_install,
    "demo": check_demo,
    "plan": check_plan,
    "bench": check_bench,
    "pytest": check_pytest,
    "script": check_script,
    "mention": check_mention,
}


def test_every_command_in_the_docs_is_known():
    """Each command of the docs and of examples/train.py's usage matches a rule and passes
    its checks (no command runs here); each ```python block parses."""
    commands = doc_commands()
    assert {c.doc for c in commands} >= {"README.md", "docs/dropin.md", "docs/plan.md"}
    assert sum(rule(c) == "demo" for c in commands) >= 4
    problems = []
    for command in commands + header_commands():
        kind = rule(command)
        if kind is None:
            problems.append(
                f"{command.doc}: `{command.text}`: no rule (tests/project/test_doc_commands.py)"
            )
            continue
        found = CHECKS[kind](command) + check_env(command)
        problems += [f"{command.doc}: `{command.text}`: {p}" for p in found]
    for path in DOCS:
        for fence in FENCE.finditer(path.read_text()):
            if fence[2] == "python":
                code = "\n".join(line[len(fence[1]) :] for line in fence[3].splitlines())
                try:
                    ast.parse(code)
                except SyntaxError as e:
                    problems.append(f"{path.relative_to(ROOT)}: a python block: {e}")
    assert not problems, "\n".join(problems)


# --- the commands that run on a CPU --------------------------------------------------


def test_the_demo_commands_of_the_docs_run(world, tmp_path):
    """Every `torchrun ... examples/train.py` of the docs (each once) on a World of its
    size, in the doc's order from one directory per doc: exit code 0 on every rank, and
    the parity line OK."""
    runs, seen = {}, set()
    for command in doc_commands():
        if rule(command) == "demo" and command.text not in seen:
            seen.add(command.text)
            ranks = int(command.words[2])
            runs.setdefault((command.doc, ranks), []).append(command.words[4:])
    assert len(seen) >= 3
    for (doc, ranks), argvs in runs.items():
        cwd = tmp_path / doc.replace("/", "-")
        cwd.mkdir()
        results = world(ranks).run(demo.run, argvs, str(cwd))
        for rank, outcomes in enumerate(results):
            for argv, (code, stdout, stderr) in zip(argvs, outcomes, strict=True):
                assert code == 0, f"{doc}: {' '.join(argv)} (rank {rank}):\n{stdout}{stderr}"
                if rank == 0:
                    assert re.search(r"^parity: .*: OK$", stdout, re.M), stdout


class _Searched(Exception):
    pass


def test_the_planner_commands_of_the_docs_run(tmp_path, monkeypatch, capsys):
    """`python -m fusedpar.plan` of the docs: one layout (``--layout``) runs and prints its
    estimate (exit 0, or 1 where it does not fit); a search runs to the search (the
    model read, the device made), which a stub stands in for."""
    from fusedpar.plan import __main__ as cli

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    monkeypatch.chdir(tmp_path)

    def search(*args, **kwargs):
        raise _Searched

    monkeypatch.setattr(cli, "search", search)
    commands = [c for c in doc_commands() if rule(c) == "plan"]
    assert commands
    for command in commands:
        argv = [PLACEHOLDERS.get(word, word) for word in command.words[3:]]
        if "--layout" in argv:
            code = cli.main(argv)
            out = capsys.readouterr().out
            assert code in (0, 1), f"{command.text}: exit {code}"
            assert json.loads(out)["layout"], out
        else:
            with pytest.raises(_Searched):
                cli.main(argv)
