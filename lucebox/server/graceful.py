"""uvicorn's server, telling the engine's worker at the first Ctrl-C or SIGTERM: from then on new
and waiting requests get 503 while the running ones finish; those still running shortly before
--shutdown-timeout ends (when uvicorn would cancel them, cutting their connections) end with a 503
of their own: a whole answer's status, a stream's last event."""

from __future__ import annotations

import threading

import uvicorn


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.lucebox = state  # the app's state: its worker exists once the app has started

    def handle_exit(self, sig, frame) -> None:
        worker, timeout = self.lucebox.worker, self.config.timeout_graceful_shutdown
        if worker is not None and not self.should_exit:  # the first signal (a second one forces the exit)
            worker.begin_stop()
            if timeout is not None:  # the answers go out before uvicorn cancels what still runs
                abort = threading.Timer(max(timeout - min(1.0, timeout / 2), 0.0), worker.abort_running)
                abort.daemon = True
                abort.start()
        super().handle_exit(sig, frame)
