"""Image URLs of chat requests to bytes, under the server's rules; nothing is fetched unless allowed.

- ``data:`` URLs: always accepted, base64 only; the encoded length is bounded before decoding.
- ``http(s)://``: only for hosts in ``--allowed-media-domains`` (exact match, none by default); every address a
  host resolves to must be public (no private, loopback, link-local, multicast or reserved address), checked
  again at every redirect (at most ``MAX_REDIRECTS``, to http(s) URLs only), and the connection goes to an
  address that passed the check (``DeadlineTransport``: no second lookup). One **deadline** covers the whole
  fetch, redirects included: the earlier of ``now + timeout_s`` and the caller's ``deadline``; every connect,
  handshake and read is cut to what is left, so a host trickling a byte at a time cannot hold it longer. The
  body is read up to the byte bound and no further (sent uncompressed: ``Accept-Encoding: identity``). Fetches
  run on the policy's **own bounded thread pool** (``max_fetches`` threads, ``mmkv-media-*``), so slow hosts
  queue behind each other, never in front of other requests' work; a fetch still queued at its deadline never
  starts.
- ``file://``: only under ``--allowed-local-media-path``, opened once, component by component without
  following any symbolic link below the root (``mmkv.confined``), checked with ``fstat`` to be a regular file
  and read from that same descriptor: a folder swapped for a link at any moment cannot lead outside. Links
  under the root are not followed at all (even ones that stay inside); the root's own path may hold links.

Every refusal raises ``MediaError`` with the HTTP status the server answers: 400 (not allowed, unreachable, a
fetch error of any kind, the fetch's own timeout), 413 (over the byte bound), 504 (the caller's ``deadline``
passed first), and a message naming the flag that would allow it where one would.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import ipaddress
import os
import socket
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from ..confined import ConfinementError, open_file_beneath, open_root, read_bounded
from .http_client import DeadlineTransport

__all__ = ["DEFAULT_MAX_FETCHES", "MAX_REDIRECTS", "MediaError", "MediaPolicy", "read_image_url",
           "read_image_url_async"]  # fmt: skip

MAX_REDIRECTS = 3
DEFAULT_MAX_FETCHES = 8  # http(s) fetches in flight per server; more wait (each within its own deadline)


class MediaError(Exception):
    """An image URL the server will not or cannot read; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class MediaPolicy:
    """What image URLs a server reads (from its ``ServerConfig``), and the thread pool its fetches run on."""

    def __init__(
        self,
        allowed_domains: tuple[str, ...] = (),
        local_path: Path | None = None,
        max_bytes: int = 20 << 20,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        max_fetches: int = DEFAULT_MAX_FETCHES,
    ) -> None:
        """``timeout_s``: the whole of one http(s) fetch, redirects included. ``transport``: httpx's, for tests
        (default: the network through ``DeadlineTransport``). ``ValueError`` for a bound that is not positive."""
        if max_bytes < 1 or not timeout_s > 0 or max_fetches < 1:
            raise ValueError("MediaPolicy needs max_bytes >= 1, timeout_s > 0 and max_fetches >= 1")
        self.transport = transport
        self.allowed_domains = frozenset(d.lower().rstrip(".") for d in allowed_domains)
        self.local_path = (
            None if local_path is None else Path(local_path).resolve()
        )  # the root, links resolved
        self._local_as_given = None if local_path is None else Path(os.path.abspath(local_path))  # as written
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_fetches = max_fetches
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # made at the first fetch
        self._ssl = None  # certificate store, loaded at the first real fetch

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The fetch threads (``max_fetches`` of them, named ``mmkv-media-*``), started on first use."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.max_fetches, "mmkv-media")
            return self._pool

    def ssl_context(self):
        with self._lock:
            if self._ssl is None:
                self._ssl = httpx.create_ssl_context()
            return self._ssl

    def close(self) -> None:
        """Stop the fetch threads (running fetches end at their deadlines; queued ones are dropped)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def read_image_url(url: str, policy: MediaPolicy, deadline: float | None = None) -> bytes:
    """The encoded image ``url`` names, as bytes. ``deadline``: a ``time.monotonic()`` time by which the caller
    needs an answer (an http(s) fetch also has ``policy.timeout_s``). An http(s) fetch runs on the policy's
    pool while this thread waits; ``read_image_url_async`` waits without holding a thread. Changes nothing;
    raises ``MediaError`` (see the module docstring)."""
    scheme = _scheme(url)
    if scheme != "http":
        return _read_local(url, policy, scheme)
    end, binding = _deadline(policy, deadline)
    future = policy.pool().submit(_fetch_guarded, url, policy, end, binding)
    try:
        return future.result(timeout=max(0.0, end - time.monotonic()))
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise _late(policy, binding) from None


async def read_image_url_async(url: str, policy: MediaPolicy, deadline: float | None = None) -> bytes:
    """``read_image_url`` for the event loop: an http(s) fetch is awaited on the policy's pool (no other
    thread is held while the host is slow); ``data:`` and ``file://`` URLs are read in the calling thread
    (bounded by ``max_bytes``). Raises ``MediaError``."""
    scheme = _scheme(url)
    if scheme != "http":
        return _read_local(url, policy, scheme)
    end, binding = _deadline(policy, deadline)
    future = policy.pool().submit(_fetch_guarded, url, policy, end, binding)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), max(0.0, end - time.monotonic()))
    except asyncio.TimeoutError:
        future.cancel()
        raise _late(policy, binding) from None


def _scheme(url: str) -> str:
    """``"data"``, ``"http"`` (http or https) or ``"file"``; ``MediaError`` for anything else."""
    if not isinstance(url, str) or not url:
        raise MediaError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        return "http"
    if scheme in ("data", "file"):
        return scheme
    raise MediaError(
        f"image URLs must be data:, http(s):// or file:// URLs, got scheme {scheme or url[:20]!r}"
    )


def _read_local(url: str, policy: MediaPolicy, scheme: str) -> bytes:
    return _data_url(url, policy) if scheme == "data" else _local_file(url, policy)


def _deadline(policy: MediaPolicy, deadline: float | None) -> tuple[float, bool]:
    """The fetch's end time and whether the caller's ``deadline`` is the one that binds."""
    own = time.monotonic() + policy.timeout_s
    if deadline is not None and deadline < own:
        return deadline, True
    return own, False


def _late(policy: MediaPolicy, binding: bool) -> MediaError:
    if binding:
        return MediaError("the request's deadline passed while its image was being fetched", 504)
    return MediaError(
        f"fetching the image took longer than {policy.timeout_s:g} s (the fetch timeout); send it as a data: URL "
        "or serve it faster"
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


def _public_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, when all of them are public; ``MediaError`` otherwise."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise MediaError(f"cannot resolve the image host {host!r} ({exc})") from None
    addresses = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if not address.is_global or address.is_multicast:
            raise MediaError(
                f"the image host {host!r} resolves to a non-public address ({address}); private, loopback and "
                "link-local addresses are never fetched"
            )
        addresses.append(str(address))
    if not addresses:
        raise MediaError(f"the image host {host!r} has no address")
    return addresses


def _check_url(url: str, policy: MediaPolicy) -> None:
    """An http(s) URL on the allow-list whose host resolves to public addresses only."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaError(
            f"the image URL redirected to a {parts.scheme or 'relative'}: URL; only http(s) redirects are followed"
        )
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        raise MediaError(f"the image URL {url[:80]!r} has no host")
    if host not in policy.allowed_domains:
        raise MediaError(
            f"fetching images from {host!r} is not allowed; start the server with --allowed-media-domains {host} "
            "to allow it (or send the image as a data: URL)"
        )
    _public_addresses(host, parts.port or (443 if parts.scheme.lower() == "https" else 80))


def _fetch_guarded(url: str, policy: MediaPolicy, deadline: float, binding: bool) -> bytes:
    """``_fetch``, with every exception it can raise turned into a ``MediaError`` (on a pool thread)."""
    try:
        return _fetch(url, policy, deadline)
    except MediaError:
        raise
    except Exception as exc:  # httpx, httpcore, h11, ssl, socket, URL parsing: all of them are refusals
        if time.monotonic() >= deadline:
            raise _late(policy, binding) from None
        raise MediaError(f"fetching the image failed ({type(exc).__name__}: {str(exc)[:200]})") from None


def _refuse_other_schemes(response: httpx.Response) -> None:
    """A redirect to anything but http(s) (``data:``, ``file:``, ``javascript:``) is refused by name."""
    location = response.headers.get("location", "").strip()
    if response.is_redirect and location:
        scheme = urlsplit(urljoin(str(response.request.url), location)).scheme.lower()
        if scheme not in ("http", "https"):
            raise MediaError(
                f"the image URL redirected to a {scheme or 'relative'}: URL; only http(s) redirects are followed"
            )


def _fetch(url: str, policy: MediaPolicy, deadline: float) -> bytes:
    if time.monotonic() >= deadline:
        raise TimeoutError("the fetch was still queued at its deadline")
    transport = policy.transport or DeadlineTransport(deadline, _public_addresses, policy.ssl_context())
    timeout = httpx.Timeout(max(0.001, deadline - time.monotonic()))
    headers = {"accept-encoding": "identity"}
    hooks = {"response": [_refuse_other_schemes]}  # before httpx parses a Location itself
    with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False, transport=transport,
                      headers=headers, event_hooks=hooks) as client:  # fmt: skip
        for _ in range(MAX_REDIRECTS + 1):
            _check_url(url, policy)
            if time.monotonic() >= deadline:
                raise TimeoutError("the deadline passed between redirects")
            with client.stream("GET", url) as response:
                if response.is_redirect:
                    location = response.headers.get("location", "").strip()
                    if not location:
                        raise MediaError(
                            f"fetching the image gave HTTP {response.status_code} without a Location"
                        )
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise MediaError(f"fetching the image gave HTTP {response.status_code}")
                encoding = response.headers.get("content-encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise MediaError(
                        f"the image host sent a {encoding!r}-encoded body; images are fetched as is"
                    )
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > policy.max_bytes:
                    raise MediaError(f"the image is over the bound of {policy.max_bytes:,} bytes", 413)
                data = bytearray()
                for chunk in response.iter_bytes():  # identity only (checked above): the bytes as sent
                    data += chunk
                    if len(data) > policy.max_bytes:
                        raise MediaError(f"the image is over the bound of {policy.max_bytes:,} bytes", 413)
                    if time.monotonic() >= deadline:
                        raise TimeoutError("the body was still arriving at the deadline")
                return bytes(data)
    raise MediaError(f"the image URL redirected more than {MAX_REDIRECTS} times")


def _local_parts(path: str, policy: MediaPolicy) -> list[str]:
    """The components of ``path`` below the allowed root (as resolved, or as written), lexically; ``MediaError``
    when it is not below it."""
    normal = Path(os.path.normpath(path))
    for root in (policy.local_path, policy._local_as_given):
        if normal.is_absolute() and normal.is_relative_to(root):
            return list(normal.relative_to(root).parts)
    raise MediaError(
        f"the image file is outside {str(policy.local_path)!r}; only files under --allowed-local-media-path "
        "are read"
    )


def _local_file(url: str, policy: MediaPolicy) -> bytes:
    if policy.local_path is None:
        raise MediaError(
            "file:// image URLs are not allowed; start the server with --allowed-local-media-path DIR to allow "
            "files under DIR"
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("file:// image URLs must name a local path (file:///path)")
    path = unquote(parts.path)
    if "\0" in path:
        raise MediaError("the file:// image URL holds a NUL character")
    names = _local_parts(path, policy)
    try:
        root = open_root(policy.local_path)
    except OSError as exc:
        raise MediaError(f"--allowed-local-media-path cannot be opened ({exc.strerror})") from None
    try:
        fd = open_file_beneath(root, names)
    except ConfinementError as exc:
        raise MediaError(
            f"the image file {url[:120]!r} is refused: {exc.strerror}; below --allowed-local-media-path no "
            "symbolic link is followed (so nothing outside it is read) and only regular files are read"
        ) from None
    except (FileNotFoundError, NotADirectoryError):
        raise MediaError(f"no image file at {url[:120]!r}") from None
    except OSError as exc:
        raise MediaError(f"the image file {url[:120]!r} cannot be read ({exc.strerror})") from None
    finally:
        os.close(root)
    try:
        data = read_bounded(fd, policy.max_bytes)
    except OSError as exc:
        raise MediaError(f"the image file {url[:120]!r} cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if data is None:
        raise MediaError(f"the image is over the bound of {policy.max_bytes:,} bytes", 413)
    return data
