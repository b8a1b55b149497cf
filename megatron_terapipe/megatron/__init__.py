"""The glue to Megatron-Core and Megatron-LM. Every place that touches Megatron lives here
(docs/compatibility.md lists them). Floors, each importing only those below it:
platform/ (the version checks of Megatron's internals, and CPU mode) <- support/ (what runs and
what is refused) <- model/ (what changes in the layers) <- hooks/ (what runs inside Megatron's
step) <- measure/ (profiles measured on the device) <- args/ (flags, their checks, and the plans
they make) <- launch.py and wiring.py (they put them together for an unmodified Megatron-LM
script).

May import: plan, schedule, planner, runtime, megatron
"""
