"""How to reach the shared tier: ``valkey_url`` parsed and checked, the tenant namespace, and the
password read from where the operator keeps it (torch-free; imports no client).

One URL form per deployment shape (``docs/tiers.md``)::

    redis://[user@]host[:port][/db]                   one server
    rediss://[user@]host[:port][/db]                  one server over TLS
    unix:///path/to/valkey.sock                       one server on a local socket
    redis+cluster://[user@]host:port[,host:port...]   a Valkey/Redis Cluster, by seed nodes
    rediss+cluster://[user@]host:port[,host:port...]  the same over TLS

The cluster form names seed nodes only: the client asks them for the slot map, then talks to each
primary directly, and follows the cluster when slots move or a replica takes over.

A password is refused in the URL: a URL ends up in logs, process lists (``ps`` shows an engine's
command line) and config dumps. It comes from an environment variable (``valkey_password_env``)
or a file (``valkey_password_file``), is read when a connection is made (so a rotated file is
picked up by the next connection), and appears in no repr, log line or error message.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from urllib.parse import unquote

DEFAULT_PORT = 6379
# scheme -> (cluster, tls)
SCHEMES = {
    "redis": (False, False),
    "rediss": (False, True),
    "redis+cluster": (True, False),
    "rediss+cluster": (True, True),
}
URL_FORMS = (
    "redis://[user@]host[:port][/db], rediss://... (TLS), unix:///path.sock, "
    "redis+cluster://[user@]host:port[,host:port...] or rediss+cluster://... (TLS)"
)
# A namespace is a plain word: no ':' (the key separator), no glob characters (ACL patterns
# match on it), no braces (they would turn into a cluster hash tag).
NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class ValkeyEndpoint:
    """A parsed ``valkey_url``; ``url`` is the URL as given (it never holds a password)."""

    url: str
    cluster: bool
    tls: bool
    seeds: tuple[tuple[str, int], ...] = ()  # (host, port): the server, or a cluster's seeds
    unix_path: str | None = None
    db: int = 0
    username: str | None = None


def redact_url(url: object) -> str:
    """``url`` for a message, keeping nothing that could be a secret: everything before the
    *last* ``@`` shown as ``user:***@`` (a password may hold ``/``, ``@``, ``:``, ``?``, ``#`` or
    percent-escapes, so no other boundary is safe; no host, port or db holds an ``@``), and a
    query or fragment after it as ``?***`` (options there could carry one)."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    userinfo, at, rest = rest.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.partition(":")[0] + ":***"
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=-1)
    if cut >= 0:
        rest = rest[:cut] + "?***"
    return f"{scheme}{sep}{userinfo}{at}{rest}"


def parse_valkey_url(url: object) -> ValkeyEndpoint:
    """Check ``url`` (one of ``URL_FORMS``); ValueError saying what is wrong, password redacted."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"expected valkey_url to be a non-empty string, got {redact_url(url)!r}")
    scheme, sep, rest = url.partition("://")
    shown = redact_url(url)
    if not sep or (scheme not in SCHEMES and scheme != "unix"):
        raise ValueError(f"expected valkey_url like {URL_FORMS}, got {shown!r}")
    userinfo, at, hostpart = rest.rpartition("@")
    if at and ":" in userinfo:
        raise ValueError(
            f"expected valkey_url without a password (it would show in logs and process lists); "
            f"put it in the environment variable named by valkey_password_env or in the file "
            f"named by valkey_password_file, got {shown!r}"
        )
    if "?" in rest or "#" in rest:
        raise ValueError(
            f"expected valkey_url without a query or fragment (options are OffloadConfig "
            f"fields), got {shown!r}"
        )
    if scheme == "unix":
        if not rest.startswith("/") or rest == "/":
            raise ValueError(f"expected valkey_url unix:///path/to/socket, got {shown!r}")
        return ValkeyEndpoint(url, cluster=False, tls=False, unix_path=rest)
    cluster, tls = SCHEMES[scheme]
    hosts, _, path = hostpart.partition("/")
    db = _db(path, shown)
    if cluster and db:
        raise ValueError(f"expected no database number in a cluster valkey_url, got {shown!r}")
    seeds = tuple(_host_port(h, shown) for h in hosts.split(","))
    if not cluster and len(seeds) != 1:
        raise ValueError(
            f"expected one host in valkey_url (several seed nodes need redis+cluster://), "
            f"got {shown!r}"
        )
    return ValkeyEndpoint(url, cluster, tls, seeds, db=db, username=unquote(userinfo) or None)


def _db(path: str, shown: str) -> int:
    if not path:
        return 0
    if not path.isdigit():
        raise ValueError(f"expected a database number after the host in valkey_url, got {shown!r}")
    return int(path)


def _host_port(text: str, shown: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, tail = text[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else tail
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"expected a host in valkey_url, got {shown!r}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 1 << 16:
        raise ValueError(f"expected a port 1..65535 in valkey_url, got {shown!r}")
    return host, int(port_text)


def check_namespace(namespace: object) -> str:
    if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace):
        raise ValueError(
            f"expected valkey_namespace of 1-64 letters, digits, '_', '.' or '-' (starting with a "
            f"letter or digit), got {namespace!r}"
        )
    return namespace


@dataclass(frozen=True)
class TlsFiles:
    """Certificates for ``rediss://``: the CA that signs the servers' certificates (None: the
    system's CAs) and a client certificate + key for servers that require one."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def check(self, tls: bool) -> None:
        given = {
            "valkey_tls_ca_file": self.ca_file,
            "valkey_tls_cert_file": self.cert_file,
            "valkey_tls_key_file": self.key_file,
        }
        for name, value in given.items():
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"expected {name} to be None or a path, got {value!r}")
        named = sorted(n for n, v in given.items() if v is not None)
        if named and not tls:
            raise ValueError(
                f"expected a TLS valkey_url (rediss:// or rediss+cluster://) with {named}, got a "
                "plain-text one: the certificates would not be used"
            )
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("expected valkey_tls_cert_file with valkey_tls_key_file, got none")

    def check_readable(self) -> None:
        """ValueError naming the option whose file cannot be read (at start-up)."""
        for name, path in (
            ("valkey_tls_ca_file", self.ca_file),
            ("valkey_tls_cert_file", self.cert_file),
            ("valkey_tls_key_file", self.key_file),
        ):
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"expected {name} to be a readable file, got {path!r}")


@dataclass(frozen=True)
class Credentials:
    """Who the tier logs in as; the password is read on demand, from one source.

    Also a redis-py ``credential_provider`` (``get_credentials``), so each new connection reads
    the current password. The repr names the source, never the secret.
    """

    username: str | None = None
    password_env: str | None = None
    password_file: str | None = None
    _last: list[str] = field(default_factory=list, repr=False, compare=False)

    def check(self) -> None:
        if self.password_env is not None and self.password_file is not None:
            raise ValueError(
                "expected valkey_password_env or valkey_password_file, got both "
                f"({self.password_env!r}, {self.password_file!r})"
            )
        if self.password_env is not None and (
            not isinstance(self.password_env, str) or not ENV_NAME_RE.fullmatch(self.password_env)
        ):
            raise ValueError(
                f"expected valkey_password_env to be an environment variable name, got "
                f"{self.password_env!r}"
            )
        if self.password_file is not None and (
            not isinstance(self.password_file, str) or not self.password_file
        ):
            raise ValueError(
                f"expected valkey_password_file to be a path, got {self.password_file!r}"
            )

    @property
    def has_password(self) -> bool:
        return self.password_env is not None or self.password_file is not None

    def read_password(self) -> str:
        """The current password; ValueError naming the source when it is missing or empty."""
        if self.password_env is not None:
            value = os.environ.get(self.password_env, "")
            where = f"the environment variable {self.password_env} (valkey_password_env)"
        elif self.password_file is not None:
            where = f"the file {self.password_file} (valkey_password_file)"
            try:
                with open(self.password_file, encoding="utf-8") as f:
                    value = f.read().rstrip("\r\n")
            except OSError as e:
                raise ValueError(f"expected {where} to be readable, got {e.strerror}") from None
        else:
            raise ValueError("no password source configured")
        if not value:
            raise ValueError(f"expected the Valkey password in {where}, found it unset or empty")
        self._last[:] = [value]
        return value

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        """For redis-py, at each new connection. Where the source cannot be read now (a file
        being rotated), the last password read is used; the server then says whether it holds."""
        try:
            password = self.read_password()
        except ValueError:
            if not self._last:
                raise
            password = self._last[0]
        return (self.username or "default", password)
