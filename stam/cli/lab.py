"""The lab part seen from the ``stam`` command line: its commands are registered from it, when it is installed.

The lab (``lab/``, the project ``stam-lab``: evaluation, training, the deletion gate's calibration on replayed data
sets) is not what a deployment installs, and the product never imports it. It adds its commands through entry points:
the group ``stam.cli`` for top-level commands (``stam eval``, ``stam train``), ``stam.cli.<group>`` for a subcommand
of one of the product's command groups (``stam.cli.deletion``: ``stam deletion calibrate|label``). Each entry point is
named after the command it adds and is a ``register(subparsers)`` function, as the product's groups have.

Where the lab is not installed, each of its commands the product knows of (:data:`LAB_COMMANDS`) is still listed,
and running one says in one line that the lab part is not installed (:class:`~stam.errors.LabNotInstalled`, exit 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from importlib.metadata import entry_points

from stam.errors import LabNotInstalled

INSTALL = "pip install -e lab (make setup installs it)"
"""How to install the lab part beside the product, from a checkout of the repository."""


# a table
LAB_COMMANDS: dict[str, dict[str, str]] = {
    # group ("stam": the top level) -> the lab's commands in it, in `--help` order -> their help
    "stam": {
        "train": "teacher traces over notes and LoRA adapters for the write modules (the lab part)",
        "eval": "the paper's evaluation: write-time state, MIMIC-QA, the store gate, lifecycle (the lab part)",
    },
    "deletion": {
        "calibrate": "replay a store, label its candidates' concept types, train the scorer, choose tau on the "
                     "sealed calibration split and report the diagnostics (the lab part)",
        "label": "replay a store and label its candidates' concept types, resumable (the lab part)",
    },
}
"""The lab's commands the product knows of, so that ``stam --help`` lists them whether or not the lab is installed."""


def register(group: str, sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the lab's commands of ``group`` (``"stam"``: the top level; else one of the product's groups) to ``sub``:
    from the lab's entry points where it is installed, else each as a command that says it is not."""
    installed = {ep.name: ep for ep in entry_points(group="stam.cli" if group == "stam" else f"stam.cli.{group}")}
    known = LAB_COMMANDS.get(group, {})
    for name in [*known, *sorted(set(installed) - set(known))]:
        if name in installed:
            installed[name].load()(sub)
        else:
            _not_installed(sub, name, known[name], group)


def _not_installed(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, text: str, group: str) -> None:
    command = name if group == "stam" else f"{group} {name}"
    p = sub.add_parser(name, help=f"{text}: not installed here", description=f"stam {command}: {text}. The lab "
                       f"part is not installed here: {INSTALL}.")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command's arguments (not read: the lab part is not "
                   "installed)")
    p.set_defaults(fn=_refuse(command))


def _refuse(command: str) -> Callable[[argparse.Namespace], int]:
    def refuse(args: argparse.Namespace) -> int:
        raise LabNotInstalled(f"{command} is a command of the lab part (stam-lab), which is not installed here: "
                              f"{INSTALL}")

    return refuse
