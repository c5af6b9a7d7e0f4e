"""``mmkv serve``: an OpenAI-compatible chat-completions server over one model, reusing image KV across stateless
requests (a pool of live caches matched by prefix, and the stores for images that moved).

    from mmkv.serve import Engine, ServerConfig, create_app
    app = create_app(Engine(ServerConfig(model="small-qwen3-vl")))   # then uvicorn.run(app, ...)
"""

from .app import create_app
from .config import ServerConfig
from .engine import Engine

__all__ = ["Engine", "ServerConfig", "create_app", "serve"]


def serve(config: ServerConfig) -> None:
    """Load the model, then serve on ``config.host:config.port`` until interrupted: one log line per request
    (logger ``mmkv.serve``), connections bounded in number and time (``connections``), as many file descriptors
    as the system allows this process; the first SIGTERM drains (``drain``), SIGINT stops at once."""
    import logging
    import resource

    import uvicorn

    from .connections import guarded_protocol
    from .drain import DrainingServer

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    log = logging.getLogger("mmkv.serve")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s mmkv.serve %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    engine = Engine(config)
    try:
        settings = uvicorn.Config(
            create_app(engine), host=config.host, port=config.port, log_level="info", access_log=False,
            http=guarded_protocol(config.header_timeout_s, config.max_connections),
            timeout_keep_alive=config.keep_alive_s, timeout_graceful_shutdown=config.drain_timeout_s,
        )  # fmt: skip
        DrainingServer(settings, engine.drain, engine.busy, config.drain_timeout_s).run()
    finally:
        engine.close()
