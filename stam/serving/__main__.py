"""``python -m stam.serving``: the Ray Serve application without the rest of the CLI.

The serving images run this instead of ``stam serve`` so that they need only the serving dependencies (Ray
Serve, FastAPI, llama-cpp-python or vLLM), not the write path's (torch, Faust, Milvus). Same options as
``stam serve``.
"""

from __future__ import annotations

import argparse
import sys

from stam.errors import ServeOptionError
from stam.serving.config import ServingConfig
from stam.serving.options import add_arguments, config_from_args


def parse(argv: list[str] | None = None) -> ServingConfig:
    p = argparse.ArgumentParser(prog="python -m stam.serving", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return config_from_args(args)
    except ServeOptionError as exc:
        p.error(str(exc))
        raise  # unreachable: error() exits


def main(argv: list[str] | None = None) -> int:
    config = parse(argv)
    # deferred: stam.serving.app pulls in fastapi
    from stam.serving.app import run

    print(f"serving {config.engine.model_id} ({config.engine.kind}) at http://{config.host}:{config.port}/v1",
          file=sys.stderr)
    run(config, blocking=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
