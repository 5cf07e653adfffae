"""Hide credentials that ride inside URIs before a URI is printed or stored.

A tracking server or S3 endpoint may be configured as ``https://user:password@host/...`` (or with a token as the
user part), and signed URLs carry their signature in the query. Everything raytrain prints (console, log file) or
stores beside a run (reports, checkpoint manifests, MLflow/W&B params) goes through `redact` / `redact_tree`; the
process that was given the URI still uses the original to connect.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"

# scheme://userinfo@ : the whole userinfo goes (a bare token as user name is as secret as a password)
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#@\s'\"]+)@")
# ?name=value / &name=value where the name says it is a credential (X-Amz-Signature, token, password, api_key, ...)
_SECRET_PARAM = re.compile(
    r"(?P<key>[?&][^=&#\s]*(?:token|secret|passw(?:or)?d|signature|credential|api[_-]?key|access[_-]?key)"
    r"[^=&#\s]*=)(?P<value>[^&#\s'\"]+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the userinfo of every ``scheme://user:pass@`` and the value of credential-named query
    parameters replaced by MASK. Text without such parts comes back unchanged."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    return _SECRET_PARAM.sub(lambda m: f"{m['key']}{MASK}", text)


def redact_tree(node: Any) -> Any:
    """A copy of a JSON-like tree (dicts, lists, tuples, scalars) with `redact` applied to every string in it."""
    if isinstance(node, str):
        return redact(node)
    if isinstance(node, dict):
        return {k: redact_tree(v) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return type(node)(redact_tree(v) for v in node)
    return node
