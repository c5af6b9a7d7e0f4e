"""Image URLs of chat requests to bytes, under the server's rules; nothing is fetched unless allowed.

- ``data:`` URLs: always accepted, base64 only; the encoded length is bounded before decoding.
- ``http(s)://``: only for hosts in ``--allowed-media-domains`` (exact match, none by default); every address a
  host resolves to must be public (no private, loopback, link-local, multicast or reserved address), checked
  again at every redirect (at most ``MAX_REDIRECTS``); the body is read up to the byte bound and no further;
  connect and read time out.
- ``file://``: only under ``--allowed-local-media-path``, after resolving symbolic links.

Every refusal raises ``MediaError`` with the HTTP status the server answers (400, or 413 for size) and a message
that names the flag that would allow it. Residual risk, documented: the address check and the connection are
two lookups (a DNS answer changed between them is not caught).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx

__all__ = ["MAX_REDIRECTS", "MediaError", "MediaPolicy", "read_image_url"]

MAX_REDIRECTS = 3


class MediaError(Exception):
    """An image URL the server will not or cannot read; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class MediaPolicy:
    """What image URLs a server reads (from its ``ServerConfig``)."""

    def __init__(
        self,
        allowed_domains: tuple[str, ...] = (),
        local_path: Path | None = None,
        max_bytes: int = 20 << 20,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """``transport``: httpx's, for tests (default: the network)."""
        self.transport = transport
        self.allowed_domains = frozenset(d.lower().rstrip(".") for d in allowed_domains)
        self.local_path = None if local_path is None else Path(local_path).resolve()
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s


def read_image_url(url: str, policy: MediaPolicy) -> bytes:
    """The encoded image ``url`` names, as bytes. Raises ``MediaError`` (see the module docstring)."""
    if not isinstance(url, str) or not url:
        raise MediaError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, policy)
    if scheme in ("http", "https"):
        return _fetch(url, policy)
    if scheme == "file":
        return _local_file(url, policy)
    raise MediaError(
        f"image URLs must be data:, http(s):// or file:// URLs, got scheme {scheme or url[:20]!r}"
    )


def _data_url(url: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise MediaError("data: image URLs must be base64 (data:image/png;base64,...)")
    if len(payload) > policy.max_bytes * 4 // 3 + 4:
        raise MediaError(f"the image is over the bound of {policy.max_bytes:,} bytes", 413)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"the data: URL is not valid base64 ({exc})") from None


def _check_host(url: str, policy: MediaPolicy) -> None:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        raise MediaError(f"the image URL {url[:80]!r} has no host")
    if host not in policy.allowed_domains:
        raise MediaError(
            f"fetching images from {host!r} is not allowed; start the server with --allowed-media-domains {host} "
            "to allow it (or send the image as a data: URL)"
        )
    try:
        infos = socket.getaddrinfo(host, parts.port or (443 if parts.scheme == "https" else 80))
    except (socket.gaierror, UnicodeError) as exc:
        raise MediaError(f"cannot resolve the image host {host!r} ({exc})") from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if not address.is_global or address.is_multicast:
            raise MediaError(
                f"the image host {host!r} resolves to a non-public address ({address}); private, loopback and "
                "link-local addresses are never fetched"
            )


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    timeout = httpx.Timeout(policy.timeout_s)
    with httpx.Client(
        timeout=timeout, follow_redirects=False, trust_env=False, transport=policy.transport
    ) as client:
        for _ in range(MAX_REDIRECTS + 1):
            _check_host(url, policy)
            try:
                with client.stream("GET", url) as response:
                    if response.is_redirect:
                        location = response.headers.get("location", "")
                        url = urljoin(url, location)
                        continue
                    if response.status_code != 200:
                        raise MediaError(f"fetching the image gave HTTP {response.status_code}")
                    declared = response.headers.get("content-length")
                    if declared and declared.isdigit() and int(declared) > policy.max_bytes:
                        raise MediaError(f"the image is over the bound of {policy.max_bytes:,} bytes", 413)
                    data = bytearray()
                    for chunk in response.iter_bytes():
                        data += chunk
                        if len(data) > policy.max_bytes:
                            raise MediaError(
                                f"the image is over the bound of {policy.max_bytes:,} bytes", 413
                            )
                    return bytes(data)
            except httpx.HTTPError as exc:
                raise MediaError(f"fetching the image failed ({type(exc).__name__}: {exc})") from None
    raise MediaError(f"the image URL redirected more than {MAX_REDIRECTS} times")


def _local_file(url: str, policy: MediaPolicy) -> bytes:
    if policy.local_path is None:
        raise MediaError(
            "file:// image URLs are not allowed; start the server with --allowed-local-media-path DIR to allow "
            "files under DIR"
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("file:// image URLs must name a local path (file:///path)")
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(policy.local_path):
        raise MediaError(
            f"the image file is outside {str(policy.local_path)!r}; only files under --allowed-local-media-path "
            "are read"
        )
    if not path.is_file():
        raise MediaError(f"no image file at {url[:120]!r}")
    if path.stat().st_size > policy.max_bytes:
        raise MediaError(f"the image is over the bound of {policy.max_bytes:,} bytes", 413)
    return path.read_bytes()
