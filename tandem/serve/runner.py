"""uvicorn with a drain: how `tandem serve` (and `tandem bench --online`'s in-process server) stop.

On SIGTERM / SIGINT (or `should_exit`), uvicorn stops accepting connections and waits for the open
ones. GracefulServer bounds that wait: after `grace_s` it stops the engine driver, so each request
still in flight ends with a clear 503 `server_shutting_down` (a JSON body, or an error event and
`[DONE]` in a stream) instead of a connection cut by task cancellation, and the driver's stop
frees its KV blocks. Then the app's lifespan ends (the driver is stopped already) and the process
exits. uvicorn's own cancel-everything timeout stays as a backstop a few seconds later.
"""
from __future__ import annotations

import asyncio

import uvicorn

from tandem.serve.driver import EngineDriver

BACKSTOP_S = 5.0  # after the grace: uvicorn cancels whatever still holds a connection


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, driver: EngineDriver, grace_s: float):
        config.timeout_graceful_shutdown = grace_s + BACKSTOP_S
        super().__init__(config)
        self.driver, self.grace_s = driver, grace_s

    async def shutdown(self, sockets=None) -> None:
        stopper = asyncio.get_running_loop().create_task(self._stop_engine_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            stopper.cancel()

    async def _stop_engine_after_grace(self) -> None:
        await asyncio.sleep(self.grace_s)
        await asyncio.to_thread(self.driver.stop)  # joins the engine thread: off the event loop


def make_server(app, server, host: str, port: int, log_level: str = "info") -> GracefulServer:
    """The uvicorn server for `create_app(server)`, draining with the server's shutdown_grace_s."""
    cfg = uvicorn.Config(app, host=host, port=port, log_level=log_level)
    return GracefulServer(cfg, server.driver, server.config.shutdown_grace_s)
