"""The glue to Megatron-Core and Megatron-LM. Every place that touches Megatron lives here
(docs/compatibility.md lists them): platform/ (the version checks of Megatron's internals, and CPU
mode), hooks/ (what runs inside Megatron), measure/ (profiles measured on the device), args/
(flags, their checks, and the plans they make); launch.py and wiring.py put them together for an
unmodified Megatron-LM script.

May import: plan, schedule, planner, runtime, megatron
"""
