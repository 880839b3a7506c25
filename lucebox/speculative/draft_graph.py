"""The DFlash drafter's block pass as one CUDA graph (`graph_capture.Graphed`).

A pass reads the block's token ids (`last`, then mask tokens) and positions, uploaded together as
the graph's one static input, and the drafter's context rings, which live as long as the
proposer (a request empties them; it never reallocates them), so the graph reads them by
address. It computes every drafted row of the block (`block_width`); a round reads the first k.
Writing context rows into the rings (`DFlashProposer.catch_up`) stays eager: its row count
varies, and it runs once per several rounds.
"""

from __future__ import annotations

import torch

from lucebox.graph_capture import Graphed


class DraftGraph(Graphed[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, proposer, capture: bool, pool=None):
        super().__init__(proposer.drafter.device, capture, pool)
        self.proposer = proposer
        cfg = proposer.drafter.cfg
        # Pinned on CUDA, so the upload is asynchronous (from pageable memory it would wait for the
        # stream); the next pass writes it only once the last upload from it is done.
        self.staged = torch.full((2, cfg.block_size), cfg.mask_token_id, dtype=torch.long, pin_memory=capture)
        self.inputs = torch.zeros_like(self.staged, device=self.device)  # token ids, positions
        self._uploaded: torch.cuda.Event | None = None

    def body(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proposer.block_forward(self.inputs[0], self.inputs[1], self.proposer.block_width)

    def pass_at(self, last: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (block_width, V) and hidden states (block_width, H) of the rows after `last`,
        which sits at position `start`: the graph's outputs, overwritten by the next pass."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # long done (the round read its verdict since): no wait in practice
        staged = self.staged.numpy()  # host memory written as numpy: no device op, no dispatch
        staged[0, 0] = last
        staged[1] = range(start, start + staged.shape[1])
        self.inputs.copy_(self.staged, non_blocking=self.capture)
        if self.capture:
            self._uploaded = torch.cuda.current_stream(self.device).record_event()
        return self.run()
