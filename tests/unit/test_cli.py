"""The ``stam`` command line (issue 15): one module per command group, help on every option and subcommand,
``--version``, ``python -m stam.cli``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

import stam.cli
import stam.cli.lab
from stam.cli import GROUPS, build_parser, main, version

REPO = Path(__file__).resolve().parents[2]


def _walk(parser: argparse.ArgumentParser, path: str = "stam") -> Iterator[tuple[str, str | None]]:
    """(where, help) of every option, positional argument and subcommand, at every depth (-h/--help aside)."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}  # only subcommands added with help=
            for name, sub in action.choices.items():
                yield f"{path} {name}", helps.get(name)
                yield from _walk(sub, f"{path} {name}")
            continue
        yield f"{path} {'/'.join(action.option_strings) or action.dest}", action.help


def test_every_option_and_subcommand_has_help() -> None:
    seen = list(_walk(build_parser()))
    assert len(seen) > 140  # 147 today: every command, eval's subcommands and their options
    assert {w for w, _ in seen} >= {"stam stack", "stam eval qa", "stam eval gate --lambda", "stam publish paths"}
    missing = [where for where, text in seen if not text or text == argparse.SUPPRESS or not text.strip()]
    assert missing == []


def test_the_walk_finds_an_option_without_help() -> None:
    parser = argparse.ArgumentParser(prog="stam")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("x", help="a command")
    p.add_argument("--quiet", action="store_true")
    sub.add_parser("y")
    assert [w for w, text in _walk(parser) if not text] == ["stam x --quiet", "stam y"]


def test_every_command_of_the_overview_is_registered_by_one_group() -> None:
    """The module docstring (the top of `stam --help`) names every command; each group module registers its own."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    listed = {line.split()[1] for line in (stam.cli.__doc__ or "").splitlines() if line.startswith("  stam ")}
    assert listed == set(sub.choices)
    owners: dict[str, str] = {}
    for group in GROUPS:
        probe = argparse.ArgumentParser().add_subparsers()
        group.register(probe)
        assert probe.choices, group.__name__
        for name in probe.choices:
            assert name not in owners, (name, owners.get(name), group.__name__)
            owners[name] = group.__name__
    probe = argparse.ArgumentParser().add_subparsers()
    stam.cli.lab.register("stam", probe)  # then the lab part's commands (or their stand-ins where it is not installed)
    owners.update((name, "lab") for name in probe.choices)
    assert list(owners) == list(sub.choices)  # the groups, in order, give `stam --help`'s order


def test_the_lab_s_commands_without_the_lab_say_so_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Where only the product is installed (no stam-lab entry points), `stam eval`, `stam train` and `stam deletion
    calibrate|label` are listed still, and running one says in one line that the lab part is not installed (exit 2)."""
    monkeypatch.setattr(stam.cli.lab, "entry_points", lambda group: [])
    for argv in (["eval", "qa", "--limit", "3"], ["train", "lora"], ["deletion", "calibrate"], ["deletion", "label"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"stam: {' '.join(argv[:2 if argv[0] == 'deletion' else 1])} is a command of the lab part "
                       "(stam-lab), which is not installed here: " + stam.cli.lab.INSTALL], argv
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {"eval", "train"} <= set(sub.choices)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"stam {metadata.version('stam')}\n"
    assert version() == metadata.version("stam")


def test_version_without_the_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    monkeypatch.setattr(stam, "__version__", "9.9.9", raising=False)
    assert version() == "9.9.9"
    monkeypatch.delattr(stam, "__version__")
    assert version() == "unknown"


def test_a_users_mistake_is_argparse_s_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["bogus"], ["stack", "sideways"], ["state"], ["eval"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("stam") and ": error: " in err[-1], (argv, err)


def test_python_dash_m_stam_cli() -> None:
    # the checkout first; what the path held stays (where the lab part is on it rather than installed)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-m", "stam.cli", "--version"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout == f"stam {metadata.version('stam')}\n", res.stderr
    res = subprocess.run([sys.executable, "-m", "stam.cli", "eval", "qa", "--help"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("usage: stam eval qa "), res.stderr


def test_eval_reports_the_usage_of_either_reader() -> None:
    """`stam eval qa --reader-url` reports the endpoint client's token accounting (a `Usage`), the in-process
    reader its dict; both as a dict in the report."""
    from stam.llm.client import ChatResult
    from stam.read.reader import OpenAIReader
    from stam_lab.eval.qa_run import usage_of

    reader = OpenAIReader("http://127.0.0.1:9/v1", "m")
    reader.client.usage.add(ChatResult(content="4", prompt_tokens=10, completion_tokens=2, seconds=0.5, attempts=1))
    assert usage_of(reader) == {"calls": 1, "prompt_tokens": 10, "completion_tokens": 2, "seconds": 0.5}

    class Local:
        usage = {"calls": 2, "prompt_tokens": 3, "completion_tokens": 4}

    assert usage_of(Local()) == {"calls": 2, "prompt_tokens": 3, "completion_tokens": 4}
