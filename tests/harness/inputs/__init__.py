"""What the planner and flag tests build without starting processes: cost models and synthetic
measurements (cost_models), the random tests' draws (draws), Megatron-LM's flags on a
namespace (flags) and the config fields a piece of Megatron-Core reads (config_reads)."""
