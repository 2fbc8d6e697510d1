"""The compose stack's ingest token, made at the first start (the one-shot service `ingest-token`).

    python ingest-token.py /etc/skillstats/ingest-tokens

Writes one random bearer token (256 bits, URL-safe) to the file when it does not exist yet, mode 0600, owned
by the skillstats user (uid 10001) when run as root; a file that exists is kept as it is, so the token
stays the same across restarts until `docker compose down -v` forgets the volume. Never prints the token:
it says where to read it.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

SKILLSTATS_UID = 10001  # the image's USER


def ensure_token(path: Path) -> bool:
    """Make the tokens file if it is missing; True when this call made it."""
    if path.exists():
        return False
    part = path.with_name(path.name + ".part")
    descriptor = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(descriptor, (secrets.token_urlsafe(32) + "\n").encode())
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    if os.geteuid() == 0:
        os.chown(part, SKILLSTATS_UID, SKILLSTATS_UID)  # ingest runs as the image's user, not root
    os.replace(part, path)  # whole or not at all: ingest never reads half a token
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} TOKENS_FILE", file=sys.stderr)
        return 2
    path = Path(argv[1])
    made = ensure_token(path)
    print(
        f"ingest token {'made' if made else 'kept'} in {path} (volume ingest-tokens); read it with: "
        f"docker compose exec -T ingest cat {path}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
