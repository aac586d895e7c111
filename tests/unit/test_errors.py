"""One error family (``stam/errors.py``): every error class STAM defines lives there, and the workers sort it by
its place in the family (message fault: dead-lettered; transient: retried; anything else: a bug)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from stam import errors
from workers.stage_agent import Fault, classify

ROOT = Path(__file__).resolve().parents[2]
FAMILY = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, BaseException)]


def _product_files() -> list[Path]:
    return [p for p in [*ROOT.glob("stam/**/*.py"), *ROOT.glob("workers/*.py"), *ROOT.glob("schemas/*.py"),
                        *ROOT.glob("topology/*.py")] if p != ROOT / "stam" / "errors.py"]


def _exception_classes(paths: list[Path]) -> list[str]:
    """Public classes deriving from an exception (or named like one) defined in ``paths``."""
    names = {c.__name__ for c in FAMILY} | {"Exception", "ValueError", "RuntimeError", "ConnectionError",
                                            "KeyError", "TypeError", "OSError", "LookupError"}
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & names or node.name.endswith(("Error", "Exception")):
                    found.append(f"{path.name}:{node.name}")
    return found


def test_every_error_class_is_defined_in_stam_errors() -> None:
    assert _exception_classes(_product_files()) == []


def test_every_error_is_a_stam_error_with_a_docstring() -> None:
    for cls in FAMILY:
        assert issubclass(cls, errors.StamError), cls
        assert cls.__doc__ and cls.__doc__.strip(), f"{cls.__name__} has no docstring"


@pytest.mark.parametrize("cls", FAMILY, ids=lambda c: c.__name__)
def test_the_worker_sorts_each_error_by_its_place_in_the_family(cls: type[Exception]) -> None:
    expected = (Fault.MESSAGE if issubclass(cls, errors.MessageFault)
                else Fault.TRANSIENT if issubclass(cls, errors.Transient) else Fault.BUG)
    assert classify(cls("x")) is expected


def test_a_class_is_never_both_a_message_fault_and_transient() -> None:
    assert not [c for c in FAMILY if issubclass(c, errors.MessageFault) and issubclass(c, errors.Transient)]


def test_the_check_finds_a_stray_error_class(tmp_path: Path) -> None:
    stray = tmp_path / "stray.py"
    stray.write_text("class Probe(ValueError):\n    pass\n\n\nclass OtherError:\n    pass\n")
    assert _exception_classes([stray]) == ["stray.py:Probe", "stray.py:OtherError"]
