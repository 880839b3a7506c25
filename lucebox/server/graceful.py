"""uvicorn's server, telling the engine's worker at the first Ctrl-C or SIGTERM: from then on new
and waiting requests get 503 while the running one finishes (or is cancelled after
--shutdown-timeout, when uvicorn cancels what is still running)."""

from __future__ import annotations

import uvicorn


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.lucebox = state  # the app's state: its worker exists once the app has started

    def handle_exit(self, sig, frame) -> None:
        if self.lucebox.worker is not None:
            self.lucebox.worker.begin_stop()
        super().handle_exit(sig, frame)
