"""The lab part's commands, each a ``register(subparsers)`` function that ``lab/pyproject.toml`` names as an entry
point: ``stam eval`` (:mod:`stam_lab.cli.evaluate`), ``stam train`` (:mod:`stam_lab.cli.train`) and ``stam deletion
calibrate|label`` (:mod:`stam_lab.cli.calibrate`). The product's ``stam/cli/lab.py`` finds them there."""
