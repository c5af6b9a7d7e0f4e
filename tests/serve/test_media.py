"""Image URLs: the allow-list, address checks at every redirect, byte bounds, one deadline per fetch on its own
bounded pool, every fetch error a MediaError, data: rules. (file:// rules: test_media_files.py.)"""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from mmkv.serve import media
from mmkv.serve.media import MediaError, MediaPolicy, read_image_url

PNG = b"\x89PNG fake image bytes"


def _resolver(table: dict[str, str]):
    def getaddrinfo(host, port, *args, **kwargs):
        if host not in table:
            raise socket.gaierror(f"unknown host {host}")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[host], port))]

    return getaddrinfo


@pytest.fixture
def hosts(monkeypatch):
    table = {"images.example": "93.184.216.34", "cdn.example": "151.101.1.69", "evil.example": "93.184.216.35",
             "inside.example": "10.0.0.7", "loop.example": "127.0.0.1", "meta.example": "169.254.169.254"}  # fmt: skip
    monkeypatch.setattr(media.socket, "getaddrinfo", _resolver(table))
    return table


def _policy(handler, domains=("images.example", "cdn.example"), **kwargs) -> MediaPolicy:
    return MediaPolicy(domains, transport=httpx.MockTransport(handler), **kwargs)


def test_an_allowed_host_is_fetched(hosts):
    """An allowed public host's image comes back byte for byte."""
    assert (
        read_image_url("https://images.example/a.png", _policy(lambda r: httpx.Response(200, content=PNG)))
        == PNG
    )


@pytest.mark.parametrize(
    "url", ["https://evil.example/a.png", "http://IMAGES.example.evil.example/x", "https://1.2.3.4/x"]
)
def test_hosts_off_the_list_are_refused_naming_the_flag(hosts, url):
    """A host not on --allowed-media-domains is refused before any connection, and the message names the flag."""
    calls = []
    with pytest.raises(MediaError, match="--allowed-media-domains") as info:
        read_image_url(url, _policy(lambda r: calls.append(r) or httpx.Response(200, content=PNG)))
    assert info.value.status == 400 and calls == []


@pytest.mark.parametrize("host", ["inside.example", "loop.example", "meta.example"])
def test_allowed_hosts_on_private_addresses_are_refused(hosts, host):
    """Even an allowed host is not fetched when it resolves to a private, loopback or link-local address."""
    with pytest.raises(MediaError, match="non-public address"):
        read_image_url(
            f"http://{host}/a.png", _policy(lambda r: httpx.Response(200, content=PNG), domains=(host,))
        )


def test_every_redirect_is_checked_again(hosts):
    """A redirect to an allowed host is followed; one to a host off the list or to a private address is refused;
    a redirect loop stops after MAX_REDIRECTS."""

    def handler(request):
        path = request.url.path
        if path == "/ok":
            return httpx.Response(302, headers={"location": "https://cdn.example/final"})
        if path == "/off":
            return httpx.Response(302, headers={"location": "https://evil.example/x"})
        if path == "/private":
            return httpx.Response(302, headers={"location": "http://inside.example/x"})
        if path == "/loop":
            return httpx.Response(302, headers={"location": "/loop"})
        return httpx.Response(200, content=PNG)

    policy = _policy(handler, domains=("images.example", "cdn.example", "inside.example"))
    assert read_image_url("https://images.example/ok", policy) == PNG
    with pytest.raises(MediaError, match="--allowed-media-domains"):
        read_image_url("https://images.example/off", policy)
    with pytest.raises(MediaError, match="non-public"):
        read_image_url("https://images.example/private", policy)
    with pytest.raises(MediaError, match="redirected more than"):
        read_image_url("https://images.example/loop", policy)


def test_bodies_over_the_bound_are_cut_off(hosts):
    """A declared or actual body over the byte bound: 413, without reading past the bound."""
    big = _policy(lambda r: httpx.Response(200, content=b"x" * 5000), max_bytes=1000)
    with pytest.raises(MediaError, match="over the bound") as info:
        read_image_url("https://images.example/a.png", big)
    assert info.value.status == 413

    def streamed(request):
        return httpx.Response(200, stream=httpx.ByteStream(b"y" * 5000))  # no content-length

    with pytest.raises(MediaError, match="over the bound"):
        read_image_url("https://images.example/a.png", _policy(streamed, max_bytes=1000))


def test_http_errors_and_timeouts_are_refusals(hosts):
    """A 404 and a connection that times out give MediaError, not an exception out of the server."""
    with pytest.raises(MediaError, match="HTTP 404"):
        read_image_url("https://images.example/a.png", _policy(lambda r: httpx.Response(404)))

    def timeout(request):
        raise httpx.ReadTimeout("slow", request=request)

    with pytest.raises(MediaError, match="ReadTimeout"):
        read_image_url("https://images.example/a.png", _policy(timeout))


def test_data_urls_must_be_base64_and_small(hosts):
    """data: URLs: base64 decodes; other encodings and bad base64 are refused; too long is 413."""
    policy = MediaPolicy(max_bytes=100)
    assert read_image_url("data:image/png;base64," + base64.b64encode(b"abc").decode(), policy) == b"abc"
    for bad in ("data:image/png,rawbytes", "data:image/png;base64,!!!notbase64"):
        with pytest.raises(MediaError):
            read_image_url(bad, policy)
    with pytest.raises(MediaError) as info:
        read_image_url("data:image/png;base64," + "A" * 400, policy)
    assert info.value.status == 413


# -- one deadline per fetch ---------------------------------------------------------------------------------


class FakeClock:
    """``time.monotonic`` for the media module: moves only when a test's host says time passed."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(media, "time", SimpleNamespace(monotonic=fake))
    return fake


def _trickle(clock, every_s=5.0, count=1000):
    """A body of ``count`` single bytes, ``every_s`` (fake) seconds apart: no read ever waits long."""

    def body():
        for _ in range(count):
            clock.advance(every_s)
            yield b"x"

    return body()


def test_a_trickling_host_is_cut_at_the_fetch_deadline(hosts, clock):
    """One byte every 5 s never trips a per-read timeout; the fetch's one deadline (timeout_s) cuts it: 400,
    naming the fetch timeout, after 12 s of (fake) time, not 1000 x 5 s."""
    policy = _policy(lambda r: httpx.Response(200, content=_trickle(clock)), timeout_s=12)
    with pytest.raises(MediaError, match="longer than 12 s") as info:
        read_image_url("https://images.example/a.png", policy)
    assert info.value.status == 400 and clock.now - 1000.0 <= 15.0


def test_the_callers_deadline_binds_when_it_is_earlier(hosts, clock):
    """A request deadline 7 s away, a fetch timeout of 60 s: the trickle stops at 7 s with 504 (the request's
    deadline), not 400."""
    policy = _policy(lambda r: httpx.Response(200, content=_trickle(clock)), timeout_s=60)
    with pytest.raises(MediaError, match="request's deadline") as info:
        read_image_url("https://images.example/a.png", policy, deadline=clock() + 7)
    assert info.value.status == 504 and clock.now - 1000.0 <= 10.0


def test_slow_headers_and_slow_redirect_chains_share_the_one_deadline(hosts, clock):
    """Headers that take 20 s, and three redirects of 5 s each, against a 12 s timeout: both refused (the
    deadline covers the whole fetch, redirects included)."""

    def slow_headers(request):
        clock.advance(20)
        return httpx.Response(200, content=PNG)

    def slow_hops(request):
        clock.advance(5)
        hop = int(request.url.path.strip("/") or 0)
        if hop < 3:
            return httpx.Response(302, headers={"location": f"/{hop + 1}"})
        return httpx.Response(200, content=PNG)

    for handler in (slow_headers, slow_hops):
        with pytest.raises(MediaError, match="longer than 12 s"):
            read_image_url("https://images.example/0", _policy(handler, timeout_s=12))


def test_a_stalled_host_releases_the_caller_at_its_deadline(hosts):
    """A host that never answers: the caller (sync and async) gets 504 at its deadline while the host is still
    silent; the fetch thread ends once the host lets go."""
    release, entered = threading.Event(), []

    def stalled(request):
        entered.append(threading.current_thread().name)
        release.wait(600)  # a hang guard only
        return httpx.Response(200, content=PNG)

    policy = _policy(stalled, timeout_s=60)
    try:
        with pytest.raises(MediaError, match="request's deadline") as info:
            read_image_url("https://images.example/a.png", policy, deadline=time.monotonic() + 0.2)
        assert info.value.status == 504 and not release.is_set()
        coroutine = media.read_image_url_async("https://images.example/b.png", policy, time.monotonic() + 0.2)
        with pytest.raises(MediaError, match="request's deadline"):
            asyncio.run(coroutine)
        assert not release.is_set()
    finally:
        release.set()
        policy.close()


def test_fetches_run_on_their_own_bounded_pool(hosts, tmp_path):
    """max_fetches=2 slow hosts fill the media pool: data: and file:// images are still read at once, a third
    fetch waits in the media pool's queue and, at its deadline, is dropped without ever starting; fetches run
    on mmkv-media threads, never the caller's."""
    release, entered = threading.Event(), []
    both_in = threading.Barrier(3)

    def stalled(request):
        entered.append(threading.current_thread().name)
        if len(entered) <= 2:
            both_in.wait(600)  # hang guards only
        release.wait(600)
        return httpx.Response(200, content=PNG)

    (tmp_path / "a.png").write_bytes(PNG)
    policy = MediaPolicy(("images.example",), local_path=tmp_path, transport=httpx.MockTransport(stalled),
                         timeout_s=60, max_fetches=2)  # fmt: skip
    results = []
    callers = [threading.Thread(target=lambda: results.append(read_image_url("https://images.example/a", policy)))
               for _ in range(2)]  # fmt: skip
    try:
        for caller in callers:
            caller.start()
        both_in.wait(600)  # both pool threads are held by the slow host
        data = "data:image/png;base64," + base64.b64encode(PNG).decode()
        assert read_image_url(data, policy) == PNG
        assert read_image_url(f"file://{tmp_path / 'a.png'}", policy) == PNG
        with pytest.raises(MediaError) as info:
            read_image_url("https://images.example/third", policy, deadline=time.monotonic() + 0.2)
        assert info.value.status == 504
    finally:
        release.set()
        for caller in callers:
            caller.join(600)
        policy.close()
    assert results == [PNG, PNG] and len(entered) == 2  # the third never started
    assert all(name.startswith("mmkv-media") for name in entered)


# -- every fetch error is a MediaError ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "location",
    ["data:image/png;base64,iVBORw0KGgo=", "file:///etc/passwd", "ftp://images.example/a.png",
     "gopher://images.example/", "javascript:alert(1)"],
)  # fmt: skip
def test_redirects_to_other_schemes_are_clean_refusals(hosts, location):
    """A redirect to data:, file:, ftp:, gopher: or javascript: is a 400 naming the rule (never a 500, never
    followed)."""
    seen = []

    def handler(request):
        seen.append(str(request.url))
        return httpx.Response(302, headers={"location": location})

    with pytest.raises(MediaError, match="only http\\(s\\) redirects are followed") as info:
        read_image_url("https://images.example/a.png", _policy(handler))
    assert info.value.status == 400 and seen == ["https://images.example/a.png"]


@pytest.mark.parametrize(
    "error",
    [httpx.InvalidURL("bad url"), httpx.ConnectError("refused"), httpx.RemoteProtocolError("garbage"),
     httpx.DecodingError("bad gzip"), ssl.SSLError("bad certificate"), OSError("network down"),
     ValueError("odd header"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), RuntimeError("anything")],
    ids=lambda e: type(e).__name__,
)  # fmt: skip
def test_every_exception_a_fetch_raises_is_a_400(hosts, error):
    """Whatever the connection raises (httpx's own, ssl, socket, URL parsing, anything else) comes back as a
    MediaError 400 naming the exception type."""

    def handler(request):
        raise error

    with pytest.raises(MediaError, match=f"fetching the image failed \\({type(error).__name__}") as info:
        read_image_url("https://images.example/a.png", _policy(handler))
    assert info.value.status == 400


@pytest.mark.parametrize(
    "location", ["http://[::1", "https://images.example:99999/x", "http://exa mple/x", " "]
)
def test_malformed_redirect_locations_are_refusals(hosts, location):
    """A Location httpx or urllib cannot parse (bad IPv6, port out of range, a space, blank) is a 400."""
    handler = lambda r: httpx.Response(302, headers={"location": location})  # noqa: E731
    with pytest.raises(MediaError) as info:
        read_image_url("https://images.example/a.png", _policy(handler))
    assert info.value.status == 400


def test_compressed_bodies_are_refused(hosts):
    """Bodies are asked for and read as sent (no decompression bomb): a gzip Content-Encoding is a 400."""
    seen = []

    def handler(request):
        seen.append(request.headers.get("accept-encoding"))
        return httpx.Response(
            200, content=iter([b"\x1f\x8b" + b"\0" * 20]), headers={"content-encoding": "gzip"}
        )

    with pytest.raises(MediaError, match="gzip"):
        read_image_url("https://images.example/a.png", _policy(handler))
    assert seen == ["identity"]


def test_the_connection_goes_only_to_a_checked_address(monkeypatch):
    """DNS rebinding: the host resolves to a public address for the check and to a private one afterwards; the
    real transport connects only to an address it checked itself, so the second answer is refused before any
    connection."""
    answers = iter(["93.184.216.34", "10.0.0.7", "10.0.0.7"])
    connected = []

    def getaddrinfo(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]

    monkeypatch.setattr(media.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: connected.append(a) or 1 / 0)
    policy = MediaPolicy(("images.example",), timeout_s=30)
    try:
        with pytest.raises(MediaError, match="non-public address \\(10.0.0.7\\)") as info:
            read_image_url("http://images.example/a.png", policy)
    finally:
        policy.close()
    assert info.value.status == 400 and connected == []
