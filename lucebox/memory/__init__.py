"""Memory: the bytes a configuration needs and whether they fit this machine (`plan`), the planner
under a VRAM budget (`vram`), and MoE experts kept in host memory behind a device cache
(`expert_cache`)."""
