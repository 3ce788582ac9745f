"""Tenant authentication for a replica with no gateway in front: API keys and client certificates.

Without it, ``zl-tenant`` and ``zl-priority`` are trusted as sent: any client can book its usage
to another tenant, or label a flood ``high`` and push everyone else's requests past their
deadlines. With it, every ``/v1/*`` request proves its tenant, and the priority classes it may
claim, in one of two ways (``/health`` and ``/metrics`` stay open, as in ``vllm serve --api-key``):

- an API key as a bearer token (``authorization: Bearer <key>``, RFC 6750 section 2.1), looked up
  in a key file both stacks read (``zl-replica --api-keys``, ``zl-baseline --api-keys``);
- a client certificate verified against ``zl-replica --tls-client-ca`` (mutual TLS), whose
  tenant is :func:`certificate_tenant`'s.

The key file is TOML; each table under ``keys`` is named by the SHA-256 (hex) of one key, so the
file holds no usable secret::

    [keys.9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08]
    tenant = "acme"
    priority = "normal"   # the highest class the key may claim: high, normal or low

A request is checked by hashing its key and looking the digest up: one SHA-256 of a short key
and one dict lookup, with nothing cached per client. The lookup's timing can tell an attacker at
most how much of a SHA-256 their guess shares with a stored one, which does not help find a key:
the guarantee ``hmac.compare_digest`` gives one comparison.

:func:`write_key_file` makes a key file with fresh keys (``secrets.token_urlsafe``) and returns
the keys themselves, which appear nowhere else; the bench's production-like mode uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Final

from serving.wire.contract import (
    PRIORITIES,
    PRIORITY_NOT_ALLOWED,
    TENANT_MISMATCH,
    UNAUTHORIZED,
    ContractError,
    RequestMeta,
)

# The tenant contract.parse_headers gives a request that sends no zl-tenant: such a request is
# booked to its key's tenant.
UNNAMED_TENANT: Final = "default"
# RFC 9110 section 11.1: the auth-scheme is case-insensitive.
_BEARER: Final = b"bearer"
# An API key's length in bytes of randomness (secrets.token_urlsafe: 43 characters for 32).
KEY_BYTES: Final = 32
# How a client certificate names its tenant: a URI subject alternative name "zl-tenant:<name>".
SAN_PREFIX: Final = "zl-tenant:"
_PRIORITY_NAMES: Final = {number: name for name, number in PRIORITIES.items()}


@dataclass(frozen=True, slots=True)
class Grant:
    """What one key (or a certificate's tenant) may do: its tenant and its highest class (the
    smallest priority number it may claim, as the scheduler orders them)."""

    tenant: str
    highest: int


class Authenticator:
    """Checks each request's credentials against a key file's grants (see the module docstring).

    ``grants`` maps a key's SHA-256 hex digest to its Grant. A certificate's tenant is allowed
    the highest class of any of that tenant's keys; a tenant with no key in the file is unknown.
    """

    __slots__ = ("_by_digest", "_by_tenant")

    def __init__(self, grants: Mapping[str, Grant]) -> None:
        self._by_digest = dict(grants)
        by_tenant: dict[str, int] = {}
        for grant in grants.values():
            by_tenant[grant.tenant] = min(grant.highest, by_tenant.get(grant.tenant, grant.highest))
        self._by_tenant = by_tenant

    def __len__(self) -> int:
        return len(self._by_digest)

    def authorize(
        self, meta: RequestMeta, authorization: bytes | None, identity: str | None
    ) -> RequestMeta:
        """The request's RequestMeta with its tenant fixed by its credentials; ContractError
        (``unauthorized`` 401, ``tenant_mismatch`` or ``priority_not_allowed`` 403) otherwise.

        ``identity`` (a verified client certificate's tenant) stands in for a key; a key sent
        beside one must name the same tenant.
        """
        grant = self.credentials(authorization, identity)
        if meta.tenant != grant.tenant:
            if meta.tenant != UNNAMED_TENANT:
                raise ContractError(
                    TENANT_MISMATCH, "zl-tenant names another tenant than the credentials'"
                )
            meta = replace(meta, tenant=grant.tenant)
        if meta.priority < grant.highest:
            allowed = _PRIORITY_NAMES[grant.highest]
            raise ContractError(
                PRIORITY_NOT_ALLOWED, f"zl-priority above what the credentials allow ({allowed})"
            )
        return meta

    def credentials(self, authorization: bytes | None, identity: str | None) -> Grant:
        """The Grant a request's credentials carry; ContractError(UNAUTHORIZED) when it has none
        that the file knows, TENANT_MISMATCH when its key and its certificate disagree."""
        key_grant = None if authorization is None else self._key_grant(authorization)
        if identity is None:
            if key_grant is None:
                raise ContractError(UNAUTHORIZED, "a valid API key is required (Bearer token)")
            return key_grant
        if key_grant is not None:
            if key_grant.tenant != identity:
                raise ContractError(TENANT_MISMATCH, "the API key and the certificate disagree")
            return key_grant
        highest = self._by_tenant.get(identity)
        if highest is None:
            raise ContractError(UNAUTHORIZED, "the certificate's tenant has no grant here")
        return Grant(identity, highest)

    def _key_grant(self, authorization: bytes) -> Grant | None:
        """The Grant of a ``Bearer <key>`` header (RFC 6750 section 2.1); None for any other."""
        scheme, _, key = authorization.strip().partition(b" ")
        if scheme.lower() != _BEARER:
            return None
        return self._by_digest.get(key_digest(key.strip()))


def key_digest(key: bytes | str) -> str:
    """The SHA-256 hex digest a key file stores for ``key``."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def _is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def parse_key_file(text: str) -> dict[str, Grant]:
    """The grants of a key file's text; ValueError (one line, naming the entry) if malformed."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not TOML: {exc}") from None
    if set(data) - {"keys"}:
        raise ValueError(f"unknown tables {sorted(set(data) - {'keys'})}; expected [keys.<sha256>]")
    keys = data.get("keys", {})
    if not isinstance(keys, dict) or not keys:
        raise ValueError("no keys: expected [keys.<sha256>] tables")
    grants: dict[str, Grant] = {}
    for digest, entry in keys.items():
        where = f"keys.{digest}"
        if not _is_digest(digest):
            raise ValueError(f"{where}: the name must be a key's SHA-256, 64 lowercase hex digits")
        if not isinstance(entry, dict) or set(entry) != {"tenant", "priority"}:
            raise ValueError(f"{where}: expected exactly tenant and priority")
        tenant, priority = entry["tenant"], entry["priority"]
        if not isinstance(tenant, str) or not tenant or not tenant.isprintable():
            raise ValueError(f"{where}: tenant must be a printable, non-empty string")
        if priority not in PRIORITIES:
            raise ValueError(f"{where}: priority must be one of high, normal, low")
        grants[digest] = Grant(tenant, PRIORITIES[priority])
    return grants


def read_key_file(path: str | os.PathLike[str]) -> dict[str, Grant]:
    """The grants of the key file at ``path``; ValueError (one line, naming the file) if it is
    unreadable or malformed, so a command line can report it as its usage error."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {os.fspath(path)}: {exc}") from None
    try:
        return parse_key_file(text)
    except ValueError as exc:
        raise ValueError(f"{os.fspath(path)}: {exc}") from None


def load_key_file(path: str | os.PathLike[str]) -> Authenticator:
    """An Authenticator over the key file at ``path`` (ValueError as :func:`read_key_file`)."""
    return Authenticator(read_key_file(path))


def key_file_text(grants: Mapping[str, Grant]) -> str:
    """A key file's TOML for ``grants`` (digest -> Grant). A JSON string of a printable name is
    a TOML basic string (TOML 1.0: the same escapes), so names need no other quoting."""
    lines = ["# API keys (SHA-256 of each) -> tenant and the highest priority class it may use."]
    for digest, grant in grants.items():
        lines += [
            "",
            f"[keys.{digest}]",
            f"tenant = {json.dumps(grant.tenant, ensure_ascii=False)}",
            f'priority = "{_PRIORITY_NAMES[grant.highest]}"',
        ]
    return "\n".join(lines) + "\n"


def write_key_file(path: str | os.PathLike[str], tenants: Mapping[str, str]) -> dict[str, str]:
    """Write a key file with one fresh key per tenant (``tenants``: tenant -> the highest class
    it may use, by name) and return tenant -> key; the keys are written nowhere else. The file
    is created owner-readable only."""
    keys: dict[str, str] = {}
    grants: dict[str, Grant] = {}
    for tenant, priority in tenants.items():
        if priority not in PRIORITIES:
            raise ValueError(f"tenant {tenant!r}: priority must be one of high, normal, low")
        key = secrets.token_urlsafe(KEY_BYTES)
        keys[tenant] = key
        grants[key_digest(key)] = Grant(tenant, PRIORITIES[priority])
    text = key_file_text(grants)
    parse_key_file(text)  # a tenant name TOML cannot carry fails here, before the file exists
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)
    return keys


def certificate_tenant(certificate: Mapping[str, object]) -> str | None:
    """The tenant a verified client certificate names (``ssl.SSLObject.getpeercert()``).

    The rule: one URI subject alternative name ``zl-tenant:<name>`` (RFC 5280 section 4.2.1.6;
    a scheme of our own, as SPIFFE names workloads with ``spiffe://``); without one, the subject's
    single commonName. Two differing names, or none, give None: the request then needs a key.
    """
    alt_names = certificate.get("subjectAltName", ())
    named = {
        value[len(SAN_PREFIX) :]
        for kind, value in _pairs(alt_names)
        if kind == "URI" and value.startswith(SAN_PREFIX)
    }
    if not named:
        named = {
            value for rdn in _tuples(certificate.get("subject", ())) for kind, value in _pairs(rdn)
            if kind == "commonName"
        }  # fmt: skip
    if len(named) != 1:
        return None
    tenant = named.pop()
    return tenant if tenant and tenant.isprintable() else None


def _tuples(value: object) -> tuple[object, ...]:
    return value if isinstance(value, tuple) else ()


def _pairs(value: object) -> list[tuple[str, str]]:
    """The (name, value) string pairs in one of getpeercert()'s tuples; anything else skipped."""
    return [
        (item[0], item[1])
        for item in _tuples(value)
        if isinstance(item, tuple) and len(item) == 2
        and isinstance(item[0], str) and isinstance(item[1], str)
    ]  # fmt: skip
