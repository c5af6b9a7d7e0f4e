"""What importing mmkv costs: ``import mmkv`` loads only its errors, the rest on first use; ``mmkv.envs`` (the
simulated desktop an agent client drives) works without torch or transformers; the Redis tier's client is
imported only when a ``redis://`` store is opened, and its absence then is a clear error. Each check runs in a
fresh interpreter where the blocked modules cannot be imported (``sys.modules[name] = None``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter run from the repository root, ``blocked`` modules made unimportable."""
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    return subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_desktop_works_without_torch_transformers_or_redis():
    """An agent client's imports (mmkv.envs, mmkv.toolcalls) and a whole step of the desktop need none of them."""
    code = (
        "from mmkv.envs import DesktopApp, image_data_url, parse_tool_calls\n"
        "import mmkv.toolcalls\n"
        "app = DesktopApp(split='heldout'); first = app.reset(seed=7)\n"
        "call = app.expected_call(); result = app.step(call.name, call.arguments)\n"
        "assert image_data_url(result.image).startswith('data:image/png;base64,')\n"
        "print(sorted(m for m in ('torch', 'transformers', 'redis') if sys.modules.get(m)))\n"
    )
    done = _run(code, blocked=("torch", "transformers", "redis"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_import_mmkv_loads_only_its_errors_and_the_rest_on_first_use():
    """``import mmkv`` imports neither torch nor transformers; a public name or subpackage is imported when first
    read (the same object as in its module), and an unknown name is an AttributeError."""
    code = (
        "import mmkv\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
        "from mmkv.session import Session\n"
        "assert mmkv.Session is Session and mmkv.text.precompile and mmkv.cache.KVStore\n"
        "assert 'Session' in dir(mmkv) and isinstance(mmkv.MmkvError, type)\n"
        "try:\n    mmkv.no_such_name\nexcept AttributeError as e:\n    print(e)\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "module 'mmkv' has no attribute 'no_such_name'"]


def test_import_mmkv_and_its_stores_work_without_redis(tmp_path):
    """Without the redis package: mmkv, its memory and disk stores work; a ``redis://`` store fails at once with
    StoreUnavailableError naming ``pip install redis``."""
    code = (
        "import mmkv, mmkv.cache\n"
        f"mmkv.cache.KVStore(path={str(tmp_path)!r})\n"
        "try:\n    mmkv.cache.KVStore(path='redis://127.0.0.1:1/0')\n"
        "except mmkv.StoreUnavailableError as e:\n    print(e)\n"
    )
    done = _run(code, blocked=("redis",))
    assert done.returncode == 0, done.stderr
    assert "pip install redis" in done.stdout


@pytest.mark.parametrize("name", ["load", "Session", "KVSegment", "ModelHandle", "load_image"])
def test_every_public_name_resolves(name):
    """The names in ``mmkv.__all__`` read lazily are the real objects."""
    import mmkv

    assert name in mmkv.__all__ and getattr(mmkv, name) is not None
