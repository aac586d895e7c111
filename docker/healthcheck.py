"""Container HEALTHCHECK of the worker image: GET /healthz on the process's own web port (no curl needed).

The write worker serves it on STAM_WEB_PORT (6066), the query worker on STAM_QUERY_WEB_PORT (6067), the MLLP listener
on STAM_MLLP_WEB_PORT (6068 in compose), the FHIR endpoint on STAM_FHIR_PORT (8090); one image runs them all, so the
first port that answers 200 makes the container healthy. /healthz says the process is alive; /readyz (broker, Redis,
Milvus, model) is for orchestrators that route traffic.
"""

import os
import sys
import urllib.request


def main() -> int:
    ports = [os.environ.get("STAM_WEB_PORT", "6066"), os.environ.get("STAM_QUERY_WEB_PORT", "6067"),
             os.environ.get("STAM_MLLP_WEB_PORT", "0"), os.environ.get("STAM_FHIR_PORT", "0")]
    for port in dict.fromkeys(p for p in ports if p and p != "0"):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as resp:  # noqa: S310
                if resp.status == 200:
                    return 0
        except OSError:
            continue
    print(f"no /healthz answered 200 on ports {ports}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
