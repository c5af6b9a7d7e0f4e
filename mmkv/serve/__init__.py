"""``mmkv serve``: an OpenAI-compatible chat-completions server over one model, reusing image KV across stateless
requests (a pool of live caches matched by prefix, and the stores for images that moved).

    from mmkv.serve import Engine, ServerConfig, create_app
    app = create_app(Engine(ServerConfig(model="small-qwen3-vl")))   # then uvicorn.run(app, ...)
"""

from .app import create_app
from .config import ServerConfig
from .engine import Engine

__all__ = ["Engine", "ServerConfig", "create_app", "http_server", "serve"]


def serve(config: ServerConfig) -> None:
    """Load the model, then serve on ``config.host:config.port`` until interrupted: one log line per request
    (logger ``mmkv.serve``), connections bounded in number and time (``connections``), as many file descriptors
    as the system allows this process; the first SIGTERM drains (``drain``), SIGINT stops at once."""
    import logging
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    log = logging.getLogger("mmkv.serve")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s mmkv.serve %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    server, engine = http_server(config)
    try:
        server.run()
    finally:
        engine.close()


def http_server(config: ServerConfig, engine: Engine | None = None):
    """``(server, engine)``: the uvicorn server ``serve`` runs for ``config`` (not started: ``server.run()``
    serves until ``server.should_exit``; off the main thread it installs no signal handlers) and its engine
    (loaded here unless given; the caller closes it). Changes nothing process-wide beyond what ``Engine`` sets
    (the grammar cache's bound)."""
    import uvicorn

    from .connections import guarded_protocol
    from .drain import DrainingServer

    engine = engine or Engine(config)
    settings = uvicorn.Config(
        create_app(engine), host=config.host, port=config.port, log_level="info", access_log=False,
        http=guarded_protocol(config.header_timeout_s, config.max_connections),
        timeout_keep_alive=config.keep_alive_s, timeout_graceful_shutdown=config.drain_timeout_s,
    )  # fmt: skip
    return DrainingServer(settings, engine.drain, engine.busy, config.drain_timeout_s), engine
