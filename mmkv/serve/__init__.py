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
    """Load the model, then serve on ``config.host:config.port`` until interrupted."""
    import uvicorn

    engine = Engine(config)
    try:
        uvicorn.run(
            create_app(engine), host=config.host, port=config.port, log_level="info", access_log=False
        )
    finally:
        engine.close()
