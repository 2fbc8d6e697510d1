"""Bearer tokens from a file (SKILLSTATS_INGEST_TOKENS_FILE): one a line, re-read when the file changes.

A file, not a variable, so that Kubernetes can mount a Secret and rotate it
without a restart: the file is checked for a change (its mtime, size and inode)
at most once a second, and re-read then; a token added works within a second,
one removed stops working within a second. Blank lines and lines starting with
`#` are ignored; surrounding whitespace is not part of a token.

Tokens are compared as SHA-256 digests with `hmac.compare_digest`, against every
token of the file with no early exit, so the time an answer takes says nothing
about how much of a guess was right, nor which token it was close to. A token
is never logged; the log names the file and how many tokens it holds.

A header that is not UTF-8 reaches us with its bytes as lone surrogates
(aiohttp decodes with `surrogateescape`), which a plain `str.encode()` refuses:
that was a 500 with a traceback per request. Encoded with `surrogatepass`, any
string digests, and a surrogate matches no token of the file (read as UTF-8
text), so such a request is the 401 of any wrong token.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)
RECHECK_SECONDS = 1.0


class TokensUnreadable(OSError):
    """The tokens file cannot be read at start, or holds no token: the server does not start."""


def _bytes(text: str) -> bytes:
    """A token or header as bytes to digest; never raises, whatever came over the wire."""
    return text.encode("utf-8", "surrogatepass")


def _digest(token: str) -> bytes:
    return hashlib.sha256(_bytes(token)).digest()


class TokenFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._digests: tuple[bytes, ...] = ()
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        try:
            self._load(self._stat(), at_start=True)
        except OSError as exc:
            raise TokensUnreadable(f"cannot read the tokens file {path}: {exc.strerror or exc}") from None
        if not self._digests:
            raise TokensUnreadable(f"the tokens file {path} holds no token (one a line)")

    def __len__(self) -> int:
        return len(self._digests)

    def _stat(self) -> tuple[int, int, int]:
        info = os.stat(self.path)
        return info.st_mtime_ns, info.st_size, info.st_ino

    def _load(self, stamp: tuple[int, int, int], at_start: bool = False) -> None:
        lines = self.path.read_text().splitlines()
        tokens = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        self._digests, self._stamp = tuple(_digest(t) for t in tokens), stamp
        log.info("ingest tokens: %d from %s", len(tokens), self.path)
        if not tokens and not at_start:  # at start, no token stops the server instead
            log.warning("ingest tokens: %s holds no token now; every request is refused (401)", self.path)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < RECHECK_SECONDS:
            return
        with self._lock:
            if now - self._checked < RECHECK_SECONDS:
                return
            self._checked = now
            try:
                stamp = self._stat()
                if stamp != self._stamp:
                    self._load(stamp)
            except OSError as exc:  # mid-rotation, or removed: keep the last tokens read, and say so once
                if self._stamp is not None:
                    log.warning("ingest tokens: cannot re-read %s (%s); keeping the last ones read", self.path, exc)
                    self._stamp = None

    def allows(self, authorization: str | None) -> bool:
        """Whether an Authorization header carries one of the tokens (`Bearer <token>`)."""
        self._refresh()
        scheme, _, token = (authorization or "").partition(" ")
        candidate = _digest(token.strip())
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(candidate, digest)
        return found and scheme.lower() == "bearer" and bool(token.strip())

    @staticmethod
    def scope(authorization: str | None) -> str:
        """Whose request this is, for idempotency keys: a digest of the token, never the token."""
        _, _, token = (authorization or "").partition(" ")
        return hashlib.sha256(_bytes(token.strip())).hexdigest()[:32]
