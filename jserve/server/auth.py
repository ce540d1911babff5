"""API keys: the `--api-keys-file` format, its validation, and constant-time bearer-token checks.

The file is JSON or TOML (chosen by the `.toml` suffix), holding a list `keys` of tables:

    {"keys": [{"id": "team-a", "key": "sk-team-a-secret", "requests_per_minute": 60,
               "tokens_per_minute": 40000, "max_concurrent_requests": 4, "priority": 0},
              {"id": "batch", "key_sha256": "<64 hex digits>", "priority": 10}]}

Every field but `id` and one of `key` / `key_sha256` is optional; a missing limit means no limit. Only SHA-256
digests are kept in memory, and a token is checked against every key with `hmac.compare_digest`, so neither the
match nor its position leaks through timing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jserve.server.protocol import APIError

# Key ids become metric labels and prefix-cache salts: keep them tame.
_KEY_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,64}$")
_SHA256_HEX = re.compile(r"^[0-9a-fA-F]{64}$")
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "requests_burst", "tokens_burst")
_FIELDS = {"id", "key", "key_sha256", "priority", *_LIMITS}
# The largest value a limit or priority may take (beyond it the number is a typo, not a policy).
_MAX_LIMIT = 10**12


class ApiKeysFileError(ValueError):
    """The keys file cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class ApiKey:
    """One client key. `priority` is the scheduler priority its requests get at best (lower is served first)."""

    id: str
    digest: bytes  # sha256 of the secret
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    priority: int = 0
    requests_burst: int | None = None  # bucket size; default: a minute's worth
    tokens_burst: int | None = None

    @property
    def limited(self) -> bool:
        return any(getattr(self, name) is not None for name in _LIMITS[:3])


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def _parse_entry(entry: Any, where: str) -> ApiKey:
    if not isinstance(entry, dict):
        raise ApiKeysFileError(f"{where} must be a table/object, got {type(entry).__name__}")
    key_id = entry.get("id")
    if not isinstance(key_id, str) or not _KEY_ID.match(key_id):
        raise ApiKeysFileError(f"{where}: 'id' must be 1-64 characters of A-Z a-z 0-9 . _ : -, got {key_id!r}")
    where = f"{where} (id {key_id!r})"
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ApiKeysFileError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_FIELDS))}")
    if ("key" in entry) == ("key_sha256" in entry):
        raise ApiKeysFileError(f"{where}: give exactly one of 'key' (the secret) or 'key_sha256' (its hex digest)")
    if "key" in entry:
        secret = entry["key"]
        if not isinstance(secret, str) or not secret.strip() or secret != secret.strip():
            raise ApiKeysFileError(f"{where}: 'key' must be a non-empty string without surrounding spaces")
        digest = _digest(secret)
    else:
        hexdigest = entry["key_sha256"]
        if not isinstance(hexdigest, str) or not _SHA256_HEX.match(hexdigest):
            raise ApiKeysFileError(f"{where}: 'key_sha256' must be 64 hex digits (sha256 of the secret)")
        digest = bytes.fromhex(hexdigest)
    values: dict[str, int] = {}
    for name in _LIMITS:
        value = entry.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _MAX_LIMIT:
            raise ApiKeysFileError(f"{where}: '{name}' must be a positive integer, got {value!r}")
        values[name] = value
    priority = entry.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > _MAX_LIMIT:
        raise ApiKeysFileError(f"{where}: 'priority' must be an integer (lower is served first), got {priority!r}")
    for burst, limit in (("requests_burst", "requests_per_minute"), ("tokens_burst", "tokens_per_minute")):
        if burst in values and limit not in values:
            raise ApiKeysFileError(f"{where}: '{burst}' needs '{limit}'")
    return ApiKey(key_id, digest, priority=priority, **values)


def parse_api_keys(data: Any, source: str = "api keys") -> list[ApiKey]:
    """Validate the decoded file: a `keys` list of entries with unique ids and secrets."""
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise ApiKeysFileError(f"{source}: expected a top-level 'keys' list")
    if not data["keys"]:
        raise ApiKeysFileError(f"{source}: 'keys' is empty; give at least one key")
    keys, ids, digests = [], {}, {}
    for index, entry in enumerate(data["keys"]):
        key = _parse_entry(entry, f"{source}: keys[{index}]")
        if key.id in ids:
            raise ApiKeysFileError(f"{source}: keys[{index}]: id {key.id!r} is already used by keys[{ids[key.id]}]")
        if key.digest in digests:
            raise ApiKeysFileError(f"{source}: keys[{index}] (id {key.id!r}) has the same secret as "
                                   f"keys[{digests[key.digest]}]")
        ids[key.id], digests[key.digest] = index, index
        keys.append(key)
    return keys


def load_api_keys(path: str | Path) -> list[ApiKey]:
    """Read and validate a keys file (TOML if it ends in .toml, else JSON); ApiKeysFileError says what is wrong."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ApiKeysFileError(f"{path}: cannot read the API keys file: {e.strerror or e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8")) if path.suffix == ".toml" else json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise ApiKeysFileError(f"{path}: not valid {kind}: {e}") from None
    return parse_api_keys(data, str(path))


class KeyRing:
    """Every accepted key; `--api-key` joins as an unlimited key with id `default`."""

    def __init__(self, keys: list[ApiKey]):
        self.keys = list(keys)

    @classmethod
    def from_settings(cls, api_key: str | None, keys: list[ApiKey] | None) -> KeyRing | None:
        """None when the server takes no keys at all (no authentication)."""
        all_keys = list(keys or [])
        if api_key is not None:
            if any(k.id == "default" for k in all_keys):
                raise ApiKeysFileError("the API keys file uses id 'default', which --api-key takes")
            all_keys.append(ApiKey("default", _digest(api_key)))
        return cls(all_keys) if all_keys else None

    def match(self, token: str) -> ApiKey | None:
        """The key whose secret is `token`, comparing against every key in constant time."""
        digest = _digest(token)
        found = None
        for key in self.keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    def authenticate(self, authorization: str) -> ApiKey | None:
        """The key named by an `Authorization: Bearer ...` header value, or None."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.match(token.strip())

    def check(self, authorization: str) -> ApiKey:
        """The key of an Authorization header value, or a 401 in OpenAI's shape."""
        key = self.authenticate(authorization)
        if key is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return key
