"""Image URLs: the allow-list, address checks at every redirect, byte bounds, data: and file:// rules."""

from __future__ import annotations

import base64
import socket

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


def test_file_urls_stay_under_the_allowed_directory(tmp_path):
    """file:// reads only under --allowed-local-media-path: traversal, symlinks out and other hosts refused."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(b"secret")
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    policy = MediaPolicy(local_path=allowed)
    assert read_image_url(f"file://{allowed / 'a.png'}", policy) == PNG
    for url in (
        f"file://{allowed}/../secret.png",
        f"file://{allowed / 'link.png'}",
        f"file://{tmp_path / 'secret.png'}",
    ):
        with pytest.raises(MediaError, match="outside"):
            read_image_url(url, policy)
    with pytest.raises(MediaError, match="local path"):
        read_image_url(f"file://otherhost{allowed / 'a.png'}", policy)
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        read_image_url(f"file://{allowed / 'a.png'}", MediaPolicy())
