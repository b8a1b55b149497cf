"""The glue to Megatron-Core and Megatron-LM: layer spec, schedule install, flags, launcher,
CPU mode. Every place that touches Megatron lives here (docs/megatron.md lists them)."""
