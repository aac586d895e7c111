"""``make vllm-check``: ``stam serve --engine vllm`` on the packaged 0.5B with an adapter, end to end.

Starts ``stam serve --engine vllm --lora extract=ADAPTER`` (a subprocess, its own Ray), waits for it, sends one
structured extraction request (the reasoner's real prompt and schema, on a real Synthea note) to the base
model and one to the adapter, validates both replies with the reasoner's output model, stops the server and
prints ONE JSON line: ``ok``, ``engine``, ``device``, ``model``, ``adapter`` (its folder and whether it was
trained), ``adapter_changed_output``, ``tokens_per_s`` (completion tokens per second of engine time, base
request), ``load_s``, and per request its tokens and seconds. Exit status 0 only when ``ok``.

Without ``--adapter`` an untrained adapter (random LoRA matrices, seeded; see ``stam.serving.adapters``) is made
once in the model cache: it shows the serving path loads and applies an adapter, not that one helps.

Usage: python -m stam.serving.check [--adapter PATH] [--timeout 900] [--compiled]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from stam.llm.client import LLMClient
from stam.llm.convert import ensure_hf
from stam.llm.weights import cache_dir
from stam.net import free_port
from stam.reasoning import prompts
from stam.serving.adapters import read_meta, untrained_adapter
from stam.serving.options import installed_vllm_device

MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"
NOTE_FILE = Path("synthea-bulk-10p") / "DocumentReference.000.ndjson"
NOTE_ID = "0061f2c3-da54-f173-8dd4-84aec491b624"  # "# Medications: nitrofurantoin ...; ibuprofen 400 mg ..."


def shared_data() -> Path:
    return Path(os.environ.get("STAM_SHARED_DATA", Path(__file__).resolve().parents[2].parent / "shared" / "data"))


def note_text() -> str:
    path = shared_data() / NOTE_FILE
    for line in path.read_text().splitlines():
        if NOTE_ID in line:
            return base64.b64decode(json.loads(line)["content"][0]["attachment"]["data"]).decode()
    raise LookupError(f"note {NOTE_ID} not in {path}")


def post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def wait_up(url: str, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stam serve exited with {proc.returncode} before answering")
        try:
            urllib.request.urlopen(f"{url}/models", timeout=5).read()
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError("stam serve did not answer in time")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT (Serve and Ray shut down), then the whole process group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", type=Path, default=None, help="a peft adapter folder (default: an untrained one)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the server to come up")
    ap.add_argument("--compiled", action="store_true", help="let vLLM compile (slower start) instead of --eager")
    ap.add_argument("--log", type=Path, default=None, help="the server's output (default: a temporary file)")
    args = ap.parse_args(argv)

    result: dict[str, Any] = {"ok": False, "engine": "vllm", "model": MODEL}
    base = ensure_hf(MODEL)
    adapter = args.adapter or untrained_adapter(base, cache_dir() / f"{MODEL}.untrained-lora")
    result["adapter"] = {"path": str(adapter), "trained": bool(read_meta(adapter).get("trained", True))}
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    log = args.log or Path(os.environ.get("TMPDIR", "/tmp")) / f"stam-vllm-check-{port}.log"
    cmd = [sys.executable, "-m", "stam.cli", "serve", "--engine", "vllm", "--model", MODEL, "--port", str(port),
           "--lora", f"extract={adapter}", *([] if args.compiled else ["--eager"])]
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_up(url, proc, started + args.timeout)
        result["load_s"] = round(time.monotonic() - started, 1)
        models = json.loads(urllib.request.urlopen(f"{url}/models", timeout=10).read())
        result["device"] = installed_vllm_device()
        result["served"] = [m["id"] for m in models["data"]]
        messages = prompts.extract_messages(note_text())
        schema = prompts.schema(prompts.Extraction)
        replies: dict[str, Any] = {}
        for name in (MODEL, "extract"):
            client = LLMClient(url, name, timeout_s=600, retries=0)
            body = client.body(messages, schema=schema, schema_name="Extraction", max_tokens=800, temperature=0)
            data = post(f"{url}/chat/completions", body, 600)
            content = data["choices"][0]["message"]["content"]
            usage = data["usage"]
            try:
                facts = len(prompts.Extraction.model_validate_json(content).facts)
                valid = True
            except ValueError:
                facts, valid = 0, False
            replies[name] = {"content": content, "valid": valid, "facts": facts,
                             "completion_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"],
                             "seconds": usage["seconds"], "finish_reason": data["choices"][0]["finish_reason"]}
        b, a = replies[MODEL], replies["extract"]
        result["adapter_changed_output"] = a["content"] != b["content"]
        result["tokens_per_s"] = round(b["completion_tokens"] / b["seconds"], 2) if b["seconds"] else None
        result["requests"] = {("base" if k == MODEL else "adapter"): {x: v[x] for x in v if x != "content"}
                              for k, v in replies.items()}
        # A reply cut at max_tokens is not JSON; the grammar guarantees the rest. Both must parse for ok.
        result["ok"] = bool(b["valid"] and a["valid"] and result["adapter_changed_output"])
    except Exception as exc:  # reported in the one JSON line, with the server's log for the cause
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["log"] = str(log)
    finally:
        stop(proc)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
