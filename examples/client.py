"""An agent's two turns against ``mmkv serve`` with the official ``openai`` client, as any agent would call it.

Start a server first (``mmkv serve --model small-qwen3-vl --port 8000``), then::

    python examples/client.py --base-url http://127.0.0.1:8000/v1

Turn 1 shows a red-badge screen; turn 2 resends the whole history with that screen shown again, as agents do. The
second reply reports the first turn's prompt as cached (``usage.prompt_tokens_details.cached_tokens``) and,
in the ``mmkv`` extension object, where each image's KV came from (``live``: the pool's cache of turn 1;
``memory``: the store, spliced at its new position). On the shipped ``small-qwen3-vl``, which was trained on
single-screen decisions, turn 2 answers ``escalate(ticket)``: wrong for an admin, and exactly what full
recompute of the same history answers (the model's limit, not the cache's; the test checks the equality).
"""

from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.trajectory import NEXT_ACTION, POLICY  # noqa: E402


def image_part(name: str) -> dict:
    """An ``image_url`` part holding a shipped example screenshot as a ``data:`` URL."""
    data = base64.b64encode((ROOT / "app" / "examples" / name).read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused", help="the server's --api-key, if it has one")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages: list[dict] = [{"role": "system", "content": POLICY}]
    turns = []
    for screen in ("panel_red.png", "panel_red.png"):  # the same screen again: its KV comes from the store
        messages.append(
            {"role": "user", "content": [image_part(screen), {"type": "text", "text": NEXT_ACTION}]}
        )
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        answer = reply.choices[0].message.content
        extension = reply.model_extra["mmkv"]
        cached = reply.usage.prompt_tokens_details.cached_tokens
        print(
            f"{screen}: {answer!r}  prompt {reply.usage.prompt_tokens} tokens, cached {cached}, "
            f"images {[(i['index'], i['source']) for i in extension['images']]}, ttft {extension['ttft_ms']:.1f} ms"
        )
        turns.append({"answer": answer, "cached": cached, "prompt": reply.usage.prompt_tokens, **extension})
        messages.append({"role": "assistant", "content": answer})
    return turns


if __name__ == "__main__":
    main()
