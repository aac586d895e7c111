"""What the lab's replaying commands share (``stam eval ...``, ``stam deletion calibrate|label``): their source
options, and the check of the data folders before anything heavy loads."""

from __future__ import annotations

import argparse
from pathlib import Path

from stam.errors import SourceError
from stam.sources.mimic import is_mimic_root


def add_replay_options(q: argparse.ArgumentParser, *, source: str) -> None:
    """The options of a command that replays MIMIC-IV patients or Synthea bundles on private stores (``source``:
    the default source)."""
    q.add_argument("--source", default=source, choices=["mimic", "synthea"],
                   help="mimic: MIMIC-IV patients; synthea: Synthea R4 bundles (default: %(default)s)")
    q.add_argument("--mimic", default="../shared/data/mimic-iv-demo-2.2", help="MIMIC-IV folder (hosp/, icu/)")
    q.add_argument("--synthea", default="../shared/data/synthea-r4-bundles", help="folder of Synthea R4 bundles")
    q.add_argument("--subjects", help="comma-separated subject_ids / Synthea patient ids (default: all)")
    q.add_argument("--tables", default="poe,pharmacy,labevents", help="comma-separated MIMIC-IV tables")


def check_sources(args: argparse.Namespace) -> None:
    """The data folders a replay or evaluation command reads, checked before it loads a model: a wrong folder is
    one line in a second, not after the embedding model (and a reader) have loaded. Raises the same
    :class:`~stam.errors.SourceError` the loaders raise (``stam`` prints it in one line, exit 2)."""
    source = getattr(args, "source", None)
    mimic, synthea = getattr(args, "mimic", None), getattr(args, "synthea", None)
    if mimic and source in (None, "mimic") and not is_mimic_root(Path(mimic)):
        raise SourceError(f"{mimic} is not a MIMIC-IV folder (no hosp/admissions.csv.gz)")
    if synthea and source in (None, "synthea") and not Path(synthea).is_dir():
        raise SourceError(f"{synthea} is not a folder of Synthea bundles")
