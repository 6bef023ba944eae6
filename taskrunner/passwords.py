"""Passwords stored hashed: the dashboard's (``[dashboard] password_hash``) and run-event's
(``[run_event] password_hash``). PBKDF2-SHA256, compared in constant time; the hash is
printed by ``taskrunner dashboard --hash-password`` and ``taskrunner run-event
--hash-password`` (the same format, either works for both)."""
import hashlib
import hmac
import secrets
from typing import Optional

SCHEME = "pbkdf2_sha256"
ITERATIONS = 200_000


def hash_password(password: str, salt: Optional[str] = None) -> str:
    """``pbkdf2_sha256$<iterations>$<salt>$<hex digest>``."""
    salt = salt or secrets.token_hex(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), ITERATIONS)
    return "%s$%d$%s$%s" % (SCHEME, ITERATIONS, salt, digest.hex())


def is_hash(stored: str) -> bool:
    """Whether `stored` reads as hash_password()'s output (a password written in its place
    does not)."""
    parts = stored.split("$") if isinstance(stored, str) else ()
    return len(parts) == 4 and parts[0] == SCHEME and parts[1].isdigit() \
        and int(parts[1]) > 0 and bool(parts[2]) and len(parts[3]) == 64 \
        and all(c in "0123456789abcdef" for c in parts[3])


def check_hash(password: str, stored: str) -> bool:
    """Whether `password` is the one `stored` was made from; the digests are compared in
    constant time."""
    try:
        scheme, iterations, salt, digest = stored.split("$")
        rounds = int(iterations)
    except ValueError:
        return False
    if scheme != SCHEME:
        return False
    given = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), rounds)
    return hmac.compare_digest(given.hex(), digest)
