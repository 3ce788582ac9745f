"""Tenant authentication for a replica with no gateway in front (skeleton: being written).

Interface the replica relies on: ``Authenticator.authorize(meta, authorization, identity)``
returns the request's RequestMeta with its tenant fixed by the key (or by the client certificate's
identity) and raises ContractError (401/403, a ``zl-error`` code of its own) otherwise.
"""

from __future__ import annotations

from zerolayer.wire.contract import RequestMeta


class Authenticator:
    def authorize(
        self, meta: RequestMeta, authorization: bytes | None, identity: str | None
    ) -> RequestMeta:
        raise NotImplementedError


def certificate_tenant(certificate: dict[str, object]) -> str | None:
    """The tenant a verified client certificate names (``ssl.SSLObject.getpeercert()``)."""
    raise NotImplementedError
