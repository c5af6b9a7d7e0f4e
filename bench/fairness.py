"""Fairness under hostile requests: a plain client's latency while each class of hostile (but legal) requests
runs, and the server's memory after a cache attack, for two source trees (before and after) in one run.

One ``mmkv serve`` per tree (``--trees BEFORE AFTER``; working directory and ``PYTHONPATH`` that tree, the same
python), both up at once, only one under attack at any moment; per round, per class and level, the trees take
turns in a rotating order. Only flags both trees have are passed (``--device cpu --request-timeout``). Hostile
classes, every body distinct (a salt in it, so none is answered from a cache):

- ``recursive``: an object schema whose ``$defs``/``$ref`` cycle has no way out, as ``response_format`` (even
  requests) or as a tool's parameters with ``tool_choice: required`` (odd ones);
- ``const``: ``{"const": <a 5 MB string>}`` as ``response_format``;
- ``optional``: an object schema of 5,000 optional properties (~140 KB);
- ``anyof``: a ~300 KB ``anyOf`` nested 19 deep (objects and arrays ~40 deep, within the request bound of 64);
- ``distinct``: ~100 KB object schemas (100 enum properties);
- ``long_prompt``: a 10 MB user text message;
- ``departed``: a question with ``max_tokens`` 1500, not streamed, its connection closed after 1 s.

An arm (``--seconds-per-arm``): ``level`` hostile clients each sending its class's requests one after another
(schema classes with ``max_tokens`` 256), a plain client sending a short question (``max_tokens`` 8) one after
another, ``/health`` every 0.25 s and the server's VmRSS sampled (``/proc/<pid>/status``); the ``none`` arm has
no hostile client. When the time is up no request starts; those in flight are waited for (a client gives up
after ``--client-timeout``: status ``timeout``); then the server drains (queue empty, one plain request answered;
``--drain-s`` at most) before its next arm. Per arm: plain latency p50 / p90 / max, health p50 / max, hostile
statuses and time to answer, the drain, the peak RSS; medians [min-max] over rounds. The cache attack (once per
round and tree, first): 8 distinct ``const`` schemas at once, VmRSS before, after them and after ``--settle`` s.

Run::

    git worktree add /tmp/before 4e4cc90
    python bench/fairness.py --trees /tmp/before . --seconds-per-arm 10 --rounds 2 --json runs/fairness.json
    python bench/fairness.py --trees . --classes const departed --levels 1 --seconds-per-arm 5 --rounds 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx

if __name__ == "__main__":  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmkv.serve.process import stop  # the servers' mmkv is each tree's; this is only the process helper

SALT = "@@SALT@@"  # 8 characters, replaced by a request's number (8 digits) in a class's serialized body
PLAIN_QUESTION = "What is the capital of France? Answer in one word."
HOSTILE_MAX_TOKENS = 256  # the schema classes' answers (an ordinary bound; departed asks for 1500)
CACHE_ATTACK = 8  # distinct const schemas sent at once
_NUMBERS = itertools.count()  # request numbers (salts): every hostile body of a run is new to both servers


def _format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}


def _recursive(salt: str) -> dict:
    node = {"type": "object", "properties": {"id": {"const": salt}, "child": {"$ref": "#/$defs/node"}},
            "required": ["id", "child"]}  # fmt: skip
    return {"type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
            "$defs": {"node": node}}  # fmt: skip


def _anyof(salt: str, depth: int = 19, width: int = 50) -> dict:
    node: dict = {"const": salt}
    for d in range(depth):
        leaves = [{"type": "object", "properties": {f"k{d}_{i}_{j}": {"type": "string", "maxLength": 8} for j in range(6)}}
                  for i in range(width)]  # fmt: skip
        node = {"anyOf": [node, *leaves]}
    return node


def _optional(salt: str) -> dict:
    return {"type": "object", "properties": {f"s{salt}": {"type": "string"}} | {f"p{i}": {"type": "string"} for i in range(5000)}}  # fmt: skip


def _distinct(salt: str) -> dict:
    properties = {f"f{i}": {"enum": [f"v{i}_{j}" for j in range(100)]} for i in range(100)}
    return {"type": "object", "properties": {f"s{salt}": {"type": "string"}} | properties, "required": ["f0", "f1"]}  # fmt: skip


def _chat(content: str, max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip


# class -> the bodies its clients send in turn (request n gets the (n mod len)-th), each with SALT somewhere
CLASSES = {
    "recursive": [
        lambda s: _chat(f"{s} Describe a tree.", HOSTILE_MAX_TOKENS, **_format(_recursive(s))),
        lambda s: _chat(
            f"{s} Describe a tree.",
            HOSTILE_MAX_TOKENS,
            tool_choice="required",
            tools=[{"type": "function", "function": {"name": "tree", "parameters": _recursive(s)}}],
        ),
    ],  # fmt: skip
    "const": [lambda s: _chat(f"{s} Say it.", HOSTILE_MAX_TOKENS, **_format({"const": s + "x" * 5_000_000}))],
    "optional": [lambda s: _chat(f"{s} Fill the form.", HOSTILE_MAX_TOKENS, **_format(_optional(s)))],
    "anyof": [lambda s: _chat(f"{s} Pick one.", HOSTILE_MAX_TOKENS, **_format(_anyof(s)))],
    "distinct": [lambda s: _chat(f"{s} Fill the form.", HOSTILE_MAX_TOKENS, **_format(_distinct(s)))],
    "long_prompt": [lambda s: _chat(s + " hello world" * 873_813, HOSTILE_MAX_TOKENS)],  # 10 MB
    "departed": [lambda s: _chat(f"{s} Tell me a long story.", 1500)],
}
DEPART_AFTER_S = 1.0


def templates(name: str, model: str) -> list[bytes]:
    """A class's serialized bodies with ``SALT`` in them (``body(n)`` puts a request's number there)."""
    return [json.dumps({"model": model, **make(SALT)}).encode() for make in CLASSES[name]]


def body(bodies: list[bytes], n: int) -> bytes:
    return bodies[n % len(bodies)].replace(SALT.encode(), f"{n:08d}".encode())


class TreeServer:
    """``python -m mmkv serve`` of one source tree (working directory and ``PYTHONPATH`` the tree, so ``mmkv``
    is that tree's); a context manager, started (``/health`` answering) on enter and stopped on exit."""

    def __init__(self, tree: Path, model: str, args: list[str], log: Path, startup_s: float = 600.0) -> None:
        self.tree, self.model, self.args, self.log, self.startup_s = tree, model, args, log, startup_s
        with socket.socket() as s:  # a port free now
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> TreeServer:
        command = [sys.executable, "-m", "mmkv", "serve", "--model", self.model, "--port", str(self.port)]
        command += self.args
        with open(self.log, "w") as sink:  # cwd too: `python -m` puts the working directory first on sys.path
            self.process = subprocess.Popen(command, cwd=self.tree, env=dict(os.environ, PYTHONPATH=str(self.tree)),
                                            stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.tree}: the server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"{self.tree}: the server did not come up: {self.log.read_text()[-2000:]}")

    def rss_bytes(self) -> int:
        """The server process's resident memory now (VmRSS); 0 once it has exited."""
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return 1024 * int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass
        return 0

    def __exit__(self, *exc) -> None:
        stop(self.process)


def _send(client: httpx.Client, url: str, content: bytes | None = None) -> int | str:
    """POST ``content`` (GET without); the status, ``timeout`` or the transport error's name."""
    try:
        if content is None:
            return client.get(url).status_code
        return client.post(url, content=content, headers={"content-type": "application/json"}).status_code
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError as error:
        return type(error).__name__


def _departed(url: str, content: bytes) -> int | str:
    """Send, wait ``DEPART_AFTER_S`` for the answer, then close the connection (a new one per request)."""
    timeout = httpx.Timeout(30.0, read=DEPART_AFTER_S)  # read: the wait for the answer's first bytes
    with httpx.Client(timeout=timeout, headers={"Connection": "close"}) as client:
        status = _send(client, url, content)
    return "departed" if status == "timeout" else status


def _client(server: TreeServer, until: float, timeout: float, out: list, name: str | None = None,
            bodies: list[bytes] = (), once: bool = False) -> None:  # fmt: skip
    """One client's requests one after another until ``until`` (``once``: one), ``(status, seconds)`` each into
    ``out``: the plain question, or hostile class ``name``'s ``bodies`` (``departed``: see ``_departed``)."""
    url = f"{server.url}/v1/chat/completions"
    plain = json.dumps({"model": server.model, **_chat(PLAIN_QUESTION, 8)}).encode()
    with httpx.Client(timeout=timeout) as client:
        while (once or time.monotonic() < until) and server.process.poll() is None:
            content = body(bodies, next(_NUMBERS)) if name else plain
            started = time.perf_counter()
            status = _departed(url, content) if name == "departed" else _send(client, url, content)
            out.append((status, time.perf_counter() - started))
            if once:
                return


def _monitor(server: TreeServer, stop: threading.Event, timeout: float, health: list, rss: list) -> None:
    """``/health`` every 0.25 s (a thread of its own) and VmRSS every 0.25 s, until ``stop``."""

    def poll_health():
        with httpx.Client(timeout=timeout) as client:
            while not stop.is_set():
                started = time.perf_counter()
                health.append((_send(client, f"{server.url}/health"), time.perf_counter() - started))
                stop.wait(0.25)

    thread = threading.Thread(target=poll_health, daemon=True)
    thread.start()
    while not stop.wait(0.25):
        rss.append(server.rss_bytes())
    thread.join()


def drain(server: TreeServer, limit_s: float) -> float:
    """Seconds until the server's queue is empty (nothing running, where ``/health`` says) and a plain request
    has been answered; ``limit_s`` at most (then the next arm on this server starts on a busy one)."""
    started, out = time.monotonic(), []
    with httpx.Client(timeout=max(1.0, limit_s)) as client:
        while time.monotonic() - started < limit_s and server.process.poll() is None:
            try:
                state = client.get(f"{server.url}/health").json()
            except (httpx.HTTPError, ValueError):
                state = {"queue": 1}
            if state.get("queue", 0) == 0 and state.get("running", 0) == 0:
                _client(server, 0.0, max(1.0, limit_s - (time.monotonic() - started)), out, once=True)
                if out[-1][0] == 200:
                    break
            time.sleep(0.2)
    return time.monotonic() - started


def _ms(samples: list[tuple], prefix: str) -> dict:
    """p50 / p90 / max (ms, interpolated; None without samples) of ``(status, seconds)`` samples."""
    values = sorted(1e3 * s for _, s in samples)

    def at(q):
        i = q * (len(values) - 1)
        lo = int(i)
        return values[lo] + (values[min(lo + 1, len(values) - 1)] - values[lo]) * (i - lo) if values else None

    return {f"{prefix}_p50_ms": at(0.5), f"{prefix}_p90_ms": at(0.9), f"{prefix}_max_ms": at(1.0),
            f"{prefix}_requests": len(values), f"{prefix}_statuses": dict(Counter(str(s) for s, _ in samples))}  # fmt: skip


def run_arm(server: TreeServer, name: str | None, level: int, args) -> dict:
    """One arm: ``level`` clients of class ``name`` (None: no hostile client), the plain client and the monitor
    for ``args.seconds_per_arm``, the requests in flight waited for, then the drain. Latencies ms, memory MB."""
    bodies = templates(name, args.model) if name else []
    plain, hostile, health, rss = [], [], [], []
    stop, until, rss_start = threading.Event(), time.monotonic() + args.seconds_per_arm, server.rss_bytes()
    monitor = threading.Thread(target=_monitor, args=(server, stop, args.client_timeout, health, rss))
    workers = [threading.Thread(target=_client, args=(server, until, args.client_timeout, plain))]
    workers += [threading.Thread(target=_client, args=(server, until, args.client_timeout, hostile, name, bodies))
                for _ in range(level if name else 0)]  # fmt: skip
    for thread in [monitor, *workers]:
        thread.start()
    for worker in workers:
        worker.join()
    wall = args.seconds_per_arm + max(0.0, time.monotonic() - until)
    stop.set()
    monitor.join()
    return {**_ms(plain, "plain"), **_ms(health, "health"), **_ms(hostile, "hostile"), "wall_s": wall,
            "drain_s": drain(server, args.drain_s), "rss_start_mb": rss_start / 2**20,
            "rss_peak_mb": max(rss, default=rss_start) / 2**20, "rss_end_mb": server.rss_bytes() / 2**20}  # fmt: skip


def cache_attack(server: TreeServer, args) -> dict:
    """``CACHE_ATTACK`` distinct const schemas at once; VmRSS (MB) before, after the answers, after ``--settle``."""
    bodies, before = templates("const", args.model), server.rss_bytes()
    out, started = [], time.perf_counter()
    clients = [threading.Thread(target=_client, args=(server, 0.0, args.client_timeout, out, "const", bodies, True))
               for _ in range(CACHE_ATTACK)]  # fmt: skip
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    answered, wall = server.rss_bytes(), time.perf_counter() - started
    drain(server, args.drain_s)
    time.sleep(args.settle)
    return {"rss_before_mb": before / 2**20, "rss_after_mb": answered / 2**20,
            "rss_settled_mb": server.rss_bytes() / 2**20, "wall_s": wall,
            "statuses": dict(Counter(str(s) for s, _ in out))}  # fmt: skip


def summary(runs: list[dict]) -> dict:
    """Per figure its median, min and max over rounds; status counts summed."""
    out: dict = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = dict(sum((Counter(r[key]) for r in runs), Counter()))
        else:
            values = [r[key] for r in runs if r[key] is not None]
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None  # fmt: skip
    return out


def _commit(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def bench(args) -> dict:
    """Start one server per tree, then per round: each tree's cache attack, then every arm on each tree in turn
    (the order rotating per round). Prints a row per arm and tree as it goes."""
    trees = [Path(t).resolve() for t in args.trees]
    labels = ["before", "after"] if len(trees) == 2 else [t.name or str(t) for t in trees]
    arms = [("none", None, 0)] + [(f"{c} x{n}", c, n) for c in args.classes for n in args.levels]
    common = ["--device", "cpu", "--request-timeout", str(args.request_timeout)]  # flags both trees have
    samples: dict = {key: {label: [] for label in labels} for key, _, _ in arms}
    attacks: dict = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        logs = Path(args.log_dir or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        servers = {label: stack.enter_context(TreeServer(tree, args.model, common, logs / f"{label}.log"))
                   for label, tree in zip(labels, trees, strict=True)}  # fmt: skip
        print(HEADER, flush=True)
        for r in range(args.rounds):
            order = labels[r % len(labels) :] + labels[: r % len(labels)]
            if not args.no_attack:
                for label in order:
                    attacks[label].append(cache_attack(servers[label], args))
                    a = attacks[label][-1]
                    print(f"{'cache attack':14s} {label:7s} RSS {a['rss_before_mb']:.0f} -> {a['rss_after_mb']:.0f} "
                          f"-> {a['rss_settled_mb']:.0f} MB (settled) in {a['wall_s']:.1f} s, {a['statuses']}", flush=True)  # fmt: skip
            for key, name, level in arms:
                for label in order:
                    samples[key][label].append(run_arm(servers[label], name, level, args))
                    print(row(key, label, summary(samples[key][label][-1:])), flush=True)
                    if (code := servers[label].process.poll()) is not None:  # its later arms: no requests
                        print(
                            f"{label}: the server exited ({code}): {servers[label].log.read_text()[-1500:]}"
                        )
    results = {key: {label: {"summary": summary(runs), "rounds": runs} for label, runs in by_tree.items()}
               for key, by_tree in samples.items()}  # fmt: skip
    print(f"\nmedian [min-max] over {args.rounds} round(s)\n" + HEADER)
    for key, by_tree in results.items():
        for label, result in by_tree.items():
            print(row(key, label, result["summary"]))
    return {"args": vars(args), "trees": {label: {"path": str(t), "commit": _commit(t)} for label, t in zip(labels, trees, strict=True)},
            "cache_attack": attacks, "arms": results}  # fmt: skip


HEADER = (f"{'arm':14s} {'tree':7s} {'plain ms: p50 [range]':23s} {'p90':>7s} {'max':>7s} {'n':>4s} "
          f"{'health p50/max':>14s} {'hostile n':>9s} {'p50/max ms':>13s} {'drain s':>7s} {'peak MB':>8s}  hostile statuses")  # fmt: skip


def row(key: str, label: str, s: dict) -> str:
    """One table line of an arm's summary (one round's or the rounds'): medians, the plain p50's [min-max]."""

    def m(name, width=7):
        return f"{s[name]['median']:{width}.0f}" if s[name] else "-".rjust(width)

    p50 = s["plain_p50_ms"] or {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    plain_bad = {k: v for k, v in s["plain_statuses"].items() if k != "200"}
    return (f"{key:14s} {label:7s} {p50['median']:7.0f} [{p50['min']:.0f}-{p50['max']:.0f}]".ljust(47)
            + f"{m('plain_p90_ms')} {m('plain_max_ms')} {m('plain_requests', 4)} {m('health_p50_ms')}/{m('health_max_ms', 6)} "
            f"{m('hostile_requests', 9)} {m('hostile_p50_ms', 6)}/{m('hostile_max_ms', 6)} {s['drain_s']['median']:7.1f} "
            f"{m('rss_peak_mb', 8)}  {dict(sorted(s['hostile_statuses'].items()))}"
            + (f" plain {plain_bad}" if plain_bad else ""))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--trees", nargs="+", required=True, help="source trees (two: before and after)")
    parser.add_argument("--model", default="tiny-qwen3-vl")
    parser.add_argument("--classes", nargs="+", choices=list(CLASSES), default=list(CLASSES))
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8], help="hostile clients at once")
    parser.add_argument("--seconds-per-arm", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--request-timeout", type=float, default=10.0, help="the servers' --request-timeout")
    parser.add_argument(
        "--client-timeout", type=float, help="clients give up (default: request timeout + 10)"
    )
    parser.add_argument("--drain-s", type=float, default=30.0, help="bound on the wait for a server to drain")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds idle before the settled RSS")
    parser.add_argument("--no-attack", action="store_true", help="skip the cache attack")
    parser.add_argument("--log-dir", help="keep the servers' logs here")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.client_timeout = args.client_timeout or args.request_timeout + 10
    num_arms = (1 + len(args.classes) * len(args.levels)) * len(args.trees) * args.rounds
    num_attacks = 0 if args.no_attack else len(args.trees) * args.rounds
    least = num_arms * (args.seconds_per_arm + 2) + num_attacks * (args.settle + 4) + 30  # start-up ~30 s
    most = least + (num_arms + num_attacks) * (args.client_timeout + args.drain_s)
    print(f"model {args.model}; {num_arms} arms of {args.seconds_per_arm:g} s, {num_attacks} cache attacks: "
          f"{least / 60:.0f} min if every server keeps up, {most / 60:.0f} min at most (each arm's last requests "
          f"given up after {args.client_timeout:g} s, each drain after {args.drain_s:g} s); "
          f"load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores", flush=True)  # fmt: skip
    results = bench(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
