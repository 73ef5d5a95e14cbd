"""Who is calling, and may they: API keys, HS256 JWT bearer tokens, per-client token buckets."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path


class AuthError(Exception):
    pass


def _b64decode(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def jwt_encode(claims: dict, secret: str) -> str:
    """HS256 token (RFC 7519); used by tests and by operators minting tokens."""
    header = _b64encode(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = _b64encode(json.dumps(claims).encode())
    sig = hmac.new(secret.encode(), f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{_b64encode(sig)}"


def jwt_decode(token: str, secret: str, now: float | None = None, leeway: float = 30.0) -> dict:
    """Verify an HS256 token and its time claims; returns the claims.

    The algorithm is fixed to HS256 and read from nowhere else: trusting the header's `alg`
    is the classic JWT hole ("none", or RS256 keys reused as HMAC secrets)."""
    parts = token.split(".")
    if len(parts) != 3:
        raise AuthError("malformed bearer token")
    try:
        header = json.loads(_b64decode(parts[0]))
        claims = json.loads(_b64decode(parts[1]))
        sig = _b64decode(parts[2])
    except (ValueError, UnicodeDecodeError):
        raise AuthError("malformed bearer token") from None
    if not isinstance(header, dict) or header.get("alg") != "HS256" or not isinstance(claims, dict):
        raise AuthError("bearer token must be an HS256 JWT")
    expected = hmac.new(secret.encode(), f"{parts[0]}.{parts[1]}".encode(), hashlib.sha256).digest()
    if not hmac.compare_digest(sig, expected):
        raise AuthError("bearer token signature is invalid")
    now = time.time() if now is None else now
    if isinstance(claims.get("exp"), (int, float)) and now > claims["exp"] + leeway:
        raise AuthError("bearer token has expired")
    if isinstance(claims.get("nbf"), (int, float)) and now < claims["nbf"] - leeway:
        raise AuthError("bearer token is not valid yet")
    return claims


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
