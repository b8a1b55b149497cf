"""Worker bodies of runs compared with Megatron's own, besides the equivalence cases: virtual
stages, MoE router losses, the distributed optimizer, interleaved schedules recorded, graph
replays and capture audits, transports, injected failures (workers.py)."""
