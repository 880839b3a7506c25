"""Memory: the bytes a configuration needs (`plan`), the planner under a VRAM budget (`vram`), an
engine's memory settled before it loads (`engine`), and MoE experts kept in host memory behind a
device cache (`expert_cache`)."""
