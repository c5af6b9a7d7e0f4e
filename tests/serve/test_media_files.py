"""file:// images: only regular files below --allowed-local-media-path, opened once without following a link,
read from the descriptor that was checked; folders swapped for links mid-open lead nowhere outside. Decoys
outside the root must never be read (their bytes never come back) nor changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mmkv import confined
from mmkv.serve.media import MediaError, MediaPolicy, read_image_url

PNG = b"\x89PNG inside the root"
SECRET = b"SECRET-DECOY-BYTES outside the root"


@pytest.fixture
def tree(tmp_path):
    """``root/`` (the allowed directory) holding ``a.png`` and ``sub/b.png``, and ``outside/`` holding decoys
    named like them."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    (outside / "sub").mkdir(parents=True)
    (root / "a.png").write_bytes(PNG)
    (root / "sub" / "b.png").write_bytes(PNG)
    for path in (outside / "secret.png", outside / "b.png", outside / "sub" / "b.png"):
        path.write_bytes(SECRET)
    return root, outside


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``directory``: its bytes and modification time (ns)."""
    return {
        str(p): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _refused(url: str, policy: MediaPolicy, match: str) -> MediaError:
    with pytest.raises(MediaError, match=match) as info:
        read_image_url(url, policy)
    assert info.value.status == 400 and b"SECRET" not in str(info.value).encode()
    return info.value


def test_a_plain_file_under_the_root_is_read(tree):
    """The file's bytes, from the root or a folder below it; a file over the byte bound is 413."""
    root, _ = tree
    policy = MediaPolicy(local_path=root)
    assert read_image_url(f"file://{root / 'a.png'}", policy) == PNG
    assert read_image_url(f"file://{root / 'sub' / 'b.png'}", policy) == PNG
    with pytest.raises(MediaError, match="over the bound") as info:
        read_image_url(f"file://{root / 'a.png'}", MediaPolicy(local_path=root, max_bytes=4))
    assert info.value.status == 413


@pytest.mark.parametrize(
    "form",
    ["file link", "first-level folder link", "second-level folder link", "link that stays inside",
     "link to the root's parent"],
)  # fmt: skip
def test_links_below_the_root_are_never_followed(tree, form):
    """A link to a decoy outside (as the file itself, as a folder on the way, one folder deeper, or up to the
    root's parent), and even one that stays inside the root: refused by name, the decoys unread and
    unchanged."""
    root, outside = tree
    if form == "file link":
        (root / "link.png").symlink_to(outside / "secret.png")
        url = f"file://{root / 'link.png'}"
    elif form == "first-level folder link":
        (root / "shots").symlink_to(outside)
        url = f"file://{root / 'shots' / 'secret.png'}"
    elif form == "second-level folder link":
        (root / "sub" / "deeper").symlink_to(outside / "sub")
        url = f"file://{root / 'sub' / 'deeper' / 'b.png'}"
    elif form == "link that stays inside":
        (root / "alias.png").symlink_to(root / "a.png")
        url = f"file://{root / 'alias.png'}"
    else:
        (root / "up").symlink_to(root.parent)
        url = f"file://{root / 'up' / 'outside' / 'secret.png'}"
    before = _snapshot(outside)
    _refused(url, MediaPolicy(local_path=root), "symbolic link")
    assert _snapshot(outside) == before


@pytest.mark.parametrize(
    "path",
    ["{root}/../outside/secret.png", "{root}/%2e%2e/outside/secret.png", "{root}/sub/../../outside/secret.png",
     "{outside}/secret.png", "{root}/..%2foutside/secret.png", "//{outside}/secret.png"],
)  # fmt: skip
def test_paths_that_leave_the_root_are_refused(tree, path):
    """``..`` (plain, percent-encoded, after a folder, with an encoded slash), an absolute path outside, a
    doubled leading slash: refused as outside the root before anything is opened."""
    root, outside = tree
    url = "file://" + path.format(root=root, outside=outside)
    before = _snapshot(outside)
    _refused(url, MediaPolicy(local_path=root), "outside")
    assert _snapshot(outside) == before


def test_what_is_not_a_regular_file_is_refused_without_blocking(tree):
    """A FIFO (opening it for reading would block forever), a folder, the root itself, a NUL in the path."""
    root, _ = tree
    os.mkfifo(root / "pipe.png")
    policy = MediaPolicy(local_path=root)
    _refused(f"file://{root / 'pipe.png'}", policy, "not a regular file")
    _refused(f"file://{root / 'sub'}", policy, "not a regular file")
    _refused(f"file://{root}", policy, "no file name")
    _refused(f"file://{root}/a.png%00.png", policy, "NUL")
    _refused(f"file://{root / 'missing.png'}", policy, "no image file")


def _swap_for_link(folder: Path, target: Path) -> None:
    """Replace ``folder`` by a link to ``target`` (the real folder kept as ``folder.real``)."""
    folder.rename(folder.with_name(folder.name + ".real"))
    folder.symlink_to(target)


def test_a_folder_swapped_for_a_link_just_before_it_is_opened_is_refused(tree, monkeypatch):
    """The race of the old check-then-open: the path is fine when the request arrives, and ``sub`` becomes a
    link to the decoys right before the walk opens it. Refused; no decoy byte read."""
    root, outside = tree
    real_open_at = confined._open_at

    def racing_open_at(dir_fd, name, flags, mode=0o644):
        if name == "sub" and not (root / "sub.real").exists():
            _swap_for_link(root / "sub", outside / "sub")
        return real_open_at(dir_fd, name, flags, mode)

    monkeypatch.setattr(confined, "_open_at", racing_open_at)
    before = _snapshot(outside)
    _refused(f"file://{root / 'sub' / 'b.png'}", MediaPolicy(local_path=root), "symbolic link")
    assert _snapshot(outside) == before


def test_a_folder_swapped_after_it_was_opened_changes_nothing(tree, monkeypatch):
    """``sub`` becomes a link to the decoys after the walk opened it: the file is opened in the folder that was
    opened (now ``sub.real``), so the bytes are the inside file's, never the decoy's."""
    root, outside = tree
    real_open_at = confined._open_at

    def racing_open_at(dir_fd, name, flags, mode=0o644):
        if name == "b.png":
            _swap_for_link(root / "sub", outside / "sub")
        return real_open_at(dir_fd, name, flags, mode)

    monkeypatch.setattr(confined, "_open_at", racing_open_at)
    assert read_image_url(f"file://{root / 'sub' / 'b.png'}", MediaPolicy(local_path=root)) == PNG
    assert (root / "sub").is_symlink()  # the swap did happen


def test_a_file_swapped_for_a_link_just_before_it_is_opened_is_refused(tree, monkeypatch):
    """``a.png`` replaced by a link to a decoy between the path check and the open: refused."""
    root, outside = tree
    real_open_at = confined._open_at

    def racing_open_at(dir_fd, name, flags, mode=0o644):
        if name == "a.png" and not (root / "a.png").is_symlink():
            (root / "a.png").unlink()
            (root / "a.png").symlink_to(outside / "secret.png")
        return real_open_at(dir_fd, name, flags, mode)

    monkeypatch.setattr(confined, "_open_at", racing_open_at)
    _refused(f"file://{root / 'a.png'}", MediaPolicy(local_path=root), "symbolic link")


def test_a_root_given_through_a_link_still_works(tree, tmp_path):
    """--allowed-local-media-path may itself be a link (links above the root are the operator's): URLs under
    the path as written and under the resolved path are both read."""
    root, _ = tree
    (tmp_path / "media").symlink_to(root)
    policy = MediaPolicy(local_path=tmp_path / "media")
    assert read_image_url(f"file://{tmp_path / 'media' / 'a.png'}", policy) == PNG
    assert read_image_url(f"file://{root / 'a.png'}", policy) == PNG


def test_other_hosts_and_no_flag_are_refused(tree):
    """file://otherhost/... is refused; without --allowed-local-media-path every file:// URL is refused,
    naming the flag."""
    root, _ = tree
    _refused(f"file://otherhost{root / 'a.png'}", MediaPolicy(local_path=root), "local path")
    _refused(f"file://{root / 'a.png'}", MediaPolicy(), "--allowed-local-media-path")
