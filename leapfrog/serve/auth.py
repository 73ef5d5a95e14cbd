"""Who is calling, and may they: API keys, HS256 JWT bearer tokens (PyJWT), per-client token buckets."""
from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jwt


class AuthError(Exception):
    pass


JWT_LEEWAY_S = 30.0     # clock skew allowed on exp / nbf / iat

# PyJWT's errors as messages for the client, most specific first (InvalidSignatureError is a
# DecodeError); `{}` takes PyJWT's own wording, which names no secret.
_JWT_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (jwt.ExpiredSignatureError, "bearer token has expired"),
    (jwt.ImmatureSignatureError, "bearer token is not valid yet"),
    (jwt.InvalidSignatureError, "bearer token signature is invalid"),
    (jwt.InvalidAlgorithmError, "bearer token must be an HS256 JWT"),
    (jwt.DecodeError, "malformed bearer token: {}"),
    (jwt.InvalidTokenError, "bearer token is invalid: {}"),     # e.g. an `aud` this server cannot check
)


def jwt_encode(claims: dict, secret: str) -> str:
    """HS256 token (RFC 7519); used by tests and by operators minting tokens."""
    return jwt.encode(claims, secret, algorithm="HS256")


def jwt_decode(token: str, secret: str, leeway: float = JWT_LEEWAY_S) -> dict:
    """Verify an HS256 token (signature, then exp / nbf / iat when present, `leeway` seconds of
    clock skew allowed); returns the claims, or raises AuthError saying what is wrong."""
    try:
        # The algorithm is pinned here and read from nowhere else: trusting the header's `alg` is
        # the classic JWT hole ("none", or an RS256 public key reused as an HMAC secret).
        return jwt.decode(token, secret, algorithms=["HS256"], leeway=leeway)
    except jwt.InvalidTokenError as exc:
        message = next(m for kind, m in _JWT_ERRORS if isinstance(exc, kind))
        raise AuthError(message.format(exc)) from None


class Authenticator:
    """API keys and/or JWT; with neither configured, everyone is let in."""

    def __init__(self, api_keys: list[str], api_key_file: str | None = None,
                 jwt_secret: str | None = None) -> None:
        keys = list(api_keys)
        if api_key_file:
            lines = Path(api_key_file).read_text().splitlines()
            keys += [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        self.api_keys = [k.encode() for k in keys]
        self.jwt_secret = jwt_secret

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.jwt_secret)

    def check(self, authorization: str | None, x_api_key: str | None = None) -> str | None:
        """Returns the caller's identity (for rate limiting), None when auth is off."""
        if not self.enabled:
            return None
        token = x_api_key
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise AuthError("expected 'Authorization: Bearer <key>'")
            token = value.strip()
        if not token:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        # Compare against every key, so the time taken does not reveal which one nearly matched.
        matched = False
        for key in self.api_keys:
            matched |= hmac.compare_digest(key, token.encode())
        if matched:
            return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
        if self.jwt_secret and token.count(".") == 2:
            claims = jwt_decode(token, self.jwt_secret)
            return "jwt:" + str(claims.get("sub", ""))
        raise AuthError("incorrect API key provided")


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """Token bucket per client: `rate` requests/s refill, at most `burst` saved up."""

    def __init__(self, rate: float, burst: int = 0, max_clients: int = 100_000) -> None:
        self.rate = rate
        self.burst = float(burst or max(1.0, 2 * rate))
        self.max_clients = max_clients
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def acquire(self, client: str, now: float | None = None) -> float:
        """0.0 if the request may go ahead, else the seconds until it could (Retry-After)."""
        if not self.enabled:
            return 0.0
        now = time.monotonic() if now is None else now
        with self._lock:
            b = self._buckets.get(client)
            if b is None:
                if len(self._buckets) >= self.max_clients:   # bound memory under address churn
                    self._buckets.clear()
                b = self._buckets[client] = _Bucket(self.burst, now)
            b.tokens = min(self.burst, b.tokens + (now - b.updated) * self.rate)
            b.updated = now
            if b.tokens >= 1.0:
                b.tokens -= 1.0
                return 0.0
            return (1.0 - b.tokens) / self.rate


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
